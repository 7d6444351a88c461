// The bfloat16 FlashAttention loop on AMX tiles (Intel's Advanced Matrix Extensions: eight tile
// registers of 16 rows × 64 bytes; TDPBF16PS multiplies a 16 × 32 bfloat16 tile by a 32 × 16 one
// into 16 × 16 float32 accumulators). mh_attention_bf16 runs it where amx_takes(P).
//
// Why it exists: on a CPU with AMX, torch's SDPA runs its bfloat16 products there (oneDNN), at
// 2.5× the speed of our float32 loop; the AVX-512 loop (attention.cpp) widens bfloat16 to float32
// and runs at a third of SDPA's speed. Here both products run on the tiles and the softmax
// between them on AVX-512, and the products of the neighbouring blocks are issued between the
// softmax's rows (run_blocks). Measured limits (Intel Xeon, 2 cores, H=12, D=64): any tile
// product lowers the core's clock (the softmax alone takes 1.4× as long once one runs); a block's
// products, K and V read from L2, take about as long as its softmax and overlap it less than a
// loop with K and V in L1 does (K and V tiles forced into L1: 0.85× the time; software prefetch
// into L1 cost 1.05-1.13×, tried).
//
// Notation as attention.cpp's (B, H, Hkv, G = H / Hkv, Sq, Sk, D, Dv). Dp, Dvp: D and Dv rounded
// up to 32 and 16 (zeros); Skp: Sk rounded up to 32 (zeros, masked as not keys).
//
//   first, all threads: K and V of each (b, K/V head) packed once, as the tiles take them
//       K: per 16 keys and 32 dims, a 16 × 16 tile of bfloat16 pairs: row r, column j =
//          (K[key j][2r], K[key j][2r + 1])  (a 32-bit transpose)                    (Skp · Dp)
//       V: per 32 keys and 16 columns: row r, column j = (V[2r][j], V[2r + 1][j])          (Skp · Dvp)
//   then a work item = (b, K/V head, tile of query positions): its G heads' queries copied
//   (bfloat16, unscaled); for each head and each TR = 16 query rows, over the keys they may see
//   in blocks of KB:
//       s = q · kᵀ on the tiles (float32 sums of the exact products of the bfloat16 inputs)
//       the logit features, then -inf where the masks forbid (common.h's mask_row)
//       p = 2^(s · scale · log2 e − m), rounded to bfloat16 for the tiles; l += Σ rounded p (so
//           that o / l is exactly the mean of v these p weigh; the log-sum-exp from Σ p)
//       o += p · v on the tiles (float32; 16 × 16 columns in tile registers, the rest in memory)
//   m is a lazy reference: it moves (and o, l are rescaled) only when a row's maximum exceeds it
//   by more than LAZY (so p <= 2^LAZY); o / l is the same.
//
// Accuracy: p is rounded to bfloat16 before p · v, as FlashAttention and torch's SDPA do in
// bfloat16; everything else is float32. The RMS error against float64 is 1.05-1.4× that of the
// float32 computation rounded once (the AVX-512 loop's) and about half a naive bfloat16
// implementation's (tests/backends/test_native_amx.py).
//
// Where AMX is missing or refused (a kernel without it refuses the permission), or switched off
// (mh_amx_switch(0)), the AVX-512 loop runs instead.

#include "common.h"
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define MH_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>

namespace mh {

namespace {
std::atomic<int> amx_switch{1};  // mh_amx_switch(0) turns the AMX loop off (the tests' fallback)
}

#if MH_AMX

namespace {

constexpr int64_t TR = 16;  // query rows per tile
constexpr int64_t KB = 256;  // keys per block (a multiple of 32; 128, 192, 320, 512: 1.01-1.08× the time)
constexpr float LAZY = 8.f;  // base 2: the reference max trails a row's true one by at most this
constexpr int64_t TILE = 512;  // bfloat16 values per 16 × 64-byte tile

// Linux keeps AMX's 8 KiB of tile state off until a process asks (arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); the first tile instruction would otherwise kill it.
bool amx_permitted() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return ok;
}

// Palette 1, every tile 16 rows × 64 bytes.
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Thread-local scratch of a work item; s and p hold two blocks (the one in the softmax, the
// one whose p · v or q · kᵀ runs on the tiles meanwhile).
struct Group;
struct AmxBuffers {
    uint16_t* q;  // (G, qt_pad, Dp) queries, bfloat16
    float* s;  // (2, TR, KB) scores
    uint16_t* p;  // (2, TR, KB) probabilities, bfloat16
    float *o, *m, *l, *lx;  // (G, qt_pad, Dvp); (G, qt_pad) ×3: m, l (of the rounded p), lx (of p: lse's)
    Group* groups;  // (G · qt_pad / TR) an item's row groups
    int64_t cur = 0;  // the half of s and p the softmax works on (the other: the tiles')
    int64_t other() const { return TR * KB - cur; }
    bool ok() const { return q && s && p && o && m && l && lx && groups; }
    void release() {
        for (void* x : {(void*)q, (void*)s, (void*)p, (void*)o, (void*)m, (void*)l, (void*)lx, (void*)groups})
            std::free(x);
    }
};

inline uint16_t* alloc16(int64_t n) { return reinterpret_cast<uint16_t*>(alloc((n + 1) / 2)); }

// K of one (b, K/V head), keys [32u, 32u + 32): two 16-key tiles per 32 dims (pack layout above).
void pack_k(const Problem& P, const uint16_t* kb, int64_t u, int64_t Dp, uint16_t* __restrict dst) {
    for (int64_t n = 2 * u; n < 2 * u + 2; ++n)
        for (int64_t t = 0; t < Dp / 32; ++t) {
            uint16_t* tile = dst + (n * (Dp / 32) + t) * TILE;
            if (16 * n + 16 <= P.Sk && 32 * t + 32 <= P.D) {
                const float* rows[16];
                for (int j = 0; j < 16; ++j)
                    rows[j] = reinterpret_cast<const float*>(kb + (16 * n + j) * P.ks[2] + 32 * t);
                transpose16(rows, reinterpret_cast<float*>(tile), 16);
                continue;
            }
            for (int64_t r = 0; r < 16; ++r)
                for (int64_t j = 0; j < 16; ++j)
                    for (int64_t e = 0; e < 2; ++e) {
                        const int64_t key = 16 * n + j, d = 32 * t + 2 * r + e;
                        tile[(r * 16 + j) * 2 + e] = key < P.Sk && d < P.D ? kb[key * P.ks[2] + d] : 0;
                    }
        }
}

// V of one (b, K/V head), keys [32u, 32u + 32): one tile per 16 columns (pack layout above).
void pack_v(const Problem& P, const uint16_t* vb, int64_t u, int64_t Dvp, uint16_t* __restrict dst) {
    for (int64_t c = 0; c < Dvp / 16; ++c) {
        uint16_t* tile = dst + (u * (Dvp / 16) + c) * TILE;
        if (32 * u + 32 <= P.Sk && 16 * c + 16 <= P.Dv) {
            for (int64_t r = 0; r < 16; ++r) {
                const uint16_t* even = vb + (32 * u + 2 * r) * P.vs[2] + 16 * c;
                const uint16_t* odd = vb + (32 * u + 2 * r + 1) * P.vs[2] + 16 * c;
                const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)even));
                const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)odd));
                _mm512_storeu_si512(tile + r * 32, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
            continue;
        }
        for (int64_t r = 0; r < 16; ++r)
            for (int64_t j = 0; j < 16; ++j)
                for (int64_t e = 0; e < 2; ++e) {
                    const int64_t key = 32 * u + 2 * r + e, col = 16 * c + j;
                    tile[(r * 16 + j) * 2 + e] = key < P.Sk && col < P.Dv ? vb[key * P.vs[2] + col] : 0;
                }
    }
}

// Tiles: 0-3 o's first 64 columns (a row group long); 4 and 7 two key tiles' scores; 5 queries,
// p or an o column past the fourth; 6 keys or values, read once per row group, so with the
// streaming hint (TILELOADDT1: 0.97-0.98× the time; the scores and probabilities stay in L1).

// Scores q · kᵀ of two key tiles at a time into tiles 4 and 7, each stored (to s) only at the next
// issue or flush: a tile store waits for the products it stores, and waiting at the head of the
// reorder buffer it would stall the softmax issued after it (measured in a loop of the softmax and
// these products alone: stores right after their products 1.17× the time of stores a row later).
struct ScoreTiles {
    float* dst[2] = {nullptr, nullptr};  // where tiles 4 and 7 go; null: nothing pending

    void flush() {
        if (dst[0]) _tile_stored(4, dst[0], KB * 4);
        if (dst[1]) _tile_stored(7, dst[1], KB * 4);
        dst[0] = dst[1] = nullptr;
    }
    // Key tiles [n0, n1) (16 keys each, from key0; n0, n1 even) of q (TR rows, stride Dp) · kᵀ,
    // bound for s (row stride KB).
    void issue(const uint16_t* q, int64_t Dp, const uint16_t* kp, int64_t key0, int64_t n0, int64_t n1, float* s) {
        const int64_t steps = Dp / 32;
        for (int64_t n = n0; n < n1; n += 2) {
            flush();
            const uint16_t* kt = kp + (key0 / 16 + n) * steps * TILE;
            _tile_zero(4);
            _tile_zero(7);
            for (int64_t t = 0; t < steps; ++t) {
                _tile_loadd(5, q + 32 * t, Dp * 2);
                _tile_stream_loadd(6, kt + t * TILE, 64);
                _tile_dpbf16ps(4, 5, 6);
                _tile_stream_loadd(6, kt + (steps + t) * TILE, 64);
                _tile_dpbf16ps(7, 5, 6);
            }
            dst[0] = s + 16 * n;
            dst[1] = s + 16 * n + 16;
        }
    }
};

// Steps [u0, u1) (32 keys each, from key0) of o += p · v for o's first min(cols, 4) column tiles,
// held in tiles 0-3.
inline void pv_steps(const uint16_t* p, const uint16_t* vp, int64_t cols, int64_t key0, int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
        const uint16_t* vt = vp + (key0 / 32 + u) * cols * TILE;
        _tile_loadd(5, p + 32 * u, KB * 2);
        _tile_stream_loadd(6, vt, 64);
        _tile_dpbf16ps(0, 5, 6);
        if (cols < 2) continue;
        _tile_stream_loadd(6, vt + TILE, 64);
        _tile_dpbf16ps(1, 5, 6);
        if (cols < 3) continue;
        _tile_stream_loadd(6, vt + 2 * TILE, 64);
        _tile_dpbf16ps(2, 5, 6);
        if (cols < 4) continue;
        _tile_stream_loadd(6, vt + 3 * TILE, 64);
        _tile_dpbf16ps(3, 5, 6);
    }
}

// o += p · v for o's column tiles from the fifth on, in memory (o: TR rows, stride 16 · cols),
// keys [key0, key0 + width), with no scores pending in tiles 4 and 7 (it uses 4-6).
inline void pv_memory(const uint16_t* p, const uint16_t* vp, int64_t cols, int64_t key0, int64_t width, float* o) {
    for (int64_t c = 4; c < cols; ++c) {
        _tile_loadd(5, o + 16 * c, cols * 64);
        for (int64_t u = 0; u < width / 32; ++u) {
            _tile_loadd(4, p + 32 * u, KB * 2);
            _tile_stream_loadd(6, vp + ((key0 / 32 + u) * cols + c) * TILE, 64);
            _tile_dpbf16ps(5, 4, 6);
        }
        _tile_stored(5, o + 16 * c, cols * 64);
    }
}

// o's tiles 0..min(cols, 4)-1 stored to (store) or loaded from o (TR rows, stride 16 · cols floats).
inline void o_tiles(bool store, float* o, int64_t cols) {
    const int64_t ld = cols * 64;
    if (store) {
        _tile_stored(0, o, ld);
        if (cols > 1) _tile_stored(1, o + 16, ld);
        if (cols > 2) _tile_stored(2, o + 32, ld);
        if (cols > 3) _tile_stored(3, o + 48, ld);
    } else {
        _tile_loadd(0, o, ld);
        if (cols > 1) _tile_loadd(1, o + 16, ld);
        if (cols > 2) _tile_loadd(2, o + 32, ld);
        if (cols > 3) _tile_loadd(3, o + 48, ld);
    }
}

// 2^x for x <= LAZY + 1 in float32 (relative error < 3e-6, far below p's bfloat16 rounding);
// exactly 0 for x <= -127 (-inf: masked); NaN stays NaN. n = round(x) by the addition of
// 1.5·2^23 + 127, which leaves n + 127 in the low bits: shifted into the exponent field they are
// 2^n (0 for n = -127); 2^f, f = x - n in [-1/2, 1/2], by a degree-4 minimax polynomial.
inline __m512 exp2_amx(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-127.f), x);  // NaN stays (the second operand)
    const __m512 magic = _mm512_set1_ps(12583039.f);  // 1.5 · 2^23 + 127
    const __m512 t = _mm512_add_ps(x, magic);
    const __m512 f = _mm512_sub_ps(x, _mm512_sub_ps(t, magic));
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(9.570101276e-3f), f, _mm512_set1_ps(5.591785908e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402474433e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931217909e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999992847e-1f));
    return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(t), 23)));
}


// One row's softmax step on its scores si[0, width) (q·k, times `scale` here; masked by the
// caller): the lazy reference m (base 2), l (the sum of the rounded p), with LSE lx (the sum of
// p in float32, for the log-sum-exp), and the probabilities into p (bfloat16). Returns the
// factor o's row must be multiplied by first (1: none).
template <bool LSE>
float softmax_row(const float* __restrict si, int64_t width, float scale, float& m, float& l, float& lx,
                  uint16_t* __restrict p) {
    const float top = row_max(si, width) * scale;
    float alpha = 1.f;
    if (top > m + LAZY) {  // also the first finite maximum (m = -inf)
        alpha = m == NEG_INF ? 0.f : std::exp2(m - top);
        l *= alpha;
        lx *= alpha;
        m = top;
    }
    const __m512 sv = _mm512_set1_ps(scale), mv = _mm512_set1_ps(m == NEG_INF ? 0.f : m);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);  // bfloat16 1.0
    __m512 sum = _mm512_setzero_ps(), exact = sum;
    for (int64_t j = 0; j < width; j += 2 * W) {
        const __m512 p0 = exp2_amx(_mm512_fmsub_ps(_mm512_loadu_ps(si + j), sv, mv));
        const __m512 p1 = exp2_amx(_mm512_fmsub_ps(_mm512_loadu_ps(si + j + W), sv, mv));
        if constexpr (LSE) exact = _mm512_add_ps(exact, _mm512_add_ps(p0, p1));
        const __m512bh h = _mm512_cvtne2ps_pbh(p1, p0);  // nearest even
        _mm512_storeu_si512(p + j, (__m512i)h);
        // l sums the rounded p that p · v weighs v with (pairs of them times 1, in one instruction):
        // the output is then their weighted mean exactly (with float32 p in l, a row whose weight
        // sits on one key would be off by p's rounding: 1.2× the RMS error, not 1.05×, measured).
        sum = _mm512_dpbf16_ps(sum, h, ones);
    }
    l += _mm512_reduce_add_ps(sum);
    if constexpr (LSE) lx += _mm512_reduce_add_ps(exact);
    return alpha;
}

// One row group: TR query rows (nr of them real) of head h, from query position pos0, seeing
// keys [first, end) (first a multiple of 32), in blocks of KB keys (the last rounded up to 32).
struct Group {
    const Problem* P;
    AmxBuffers* buf;
    const uint16_t* q;  // the rows' packed queries
    int64_t b, h, pos0, nr, row0, first, end;  // row0: the first row's index into buf.o, m, l
    bool prescale;  // logit features: scale the scores first (else inside the exponential)

    int64_t blocks() const { return (end - first + KB - 1) / KB; }
    int64_t key0(int64_t j) const { return first + j * KB; }
    int64_t width(int64_t j) const { return std::min(KB, (end - key0(j) + 31) / 32 * 32); }
    float* o(int64_t cols) const { return buf->o + row0 * cols * 16; }

    // Whether every row sees every key of block j, with nothing to apply to the scores (no mask,
    // logit feature or packing): the softmax then skips mask_row (the loop 0.97-0.98× the time).
    bool whole(int64_t j) const {
        const Problem& Q = *P;
        if (prescale || Q.mask || Q.seg || key0(j) + width(j) > Q.Sk) return false;
        int64_t lo, hi, unused;  // spans grow with the position: the last row's start, the first's end
        span(Q, b, pos0 + nr - 1 + Q.Sk - Q.Sq, lo, unused);
        span(Q, b, pos0 + Q.Sk - Q.Sq, unused, hi);
        return key0(j) >= lo && key0(j) + width(j) <= hi;
    }

    // The masked softmax of row i of block j's scores s into p (row stride KB), mask_row skipped
    // where whole(j); the factor o's row must be multiplied by (1: none).
    float softmax(int64_t i, int64_t j, float* s, uint16_t* p, bool whole) const {
        const Problem& Q = *P;
        float* si = s + i * KB;
        const uint8_t* mrow = Q.mask ? Q.mask + b * Q.ms[0] + h * Q.ms[1] + (pos0 + i) * Q.ms[2] : nullptr;
        if (prescale)
            for (int64_t c = 0; c < width(j); c += W) store(si + c, load(si + c) * Q.scale);
        if (!whole)
            mask_row(Q, si, width(j), std::min(key0(j) + width(j), Q.Sk) - key0(j), key0(j), pos0 + i + Q.Sk - Q.Sq,
                     mrow, b, h);
        const float sc = prescale ? 1.f : Q.scale;
        float &m = buf->m[row0 + i], &l = buf->l[row0 + i], &lx = buf->lx[row0 + i];
        return Q.lse ? softmax_row<true>(si, width(j), sc, m, l, lx, p + i * KB)
                     : softmax_row<false>(si, width(j), sc, m, l, lx, p + i * KB);
    }
    // o's rows (in memory) times alpha where it is not 1.
    void rescale(const float* alpha, int64_t cols) const {
        for (int64_t i = 0; i < nr; ++i)
            if (alpha[i] != 1.f)
                for (int64_t t = 0; t < 16 * cols; ++t) o(cols)[i * 16 * cols + t] *= alpha[i];
    }
};

// The item's row groups' blocks as one stream: while block t's rows go through the softmax,
// block t - 1's p · v and block t + 1's q · kᵀ run on the tiles (the row groups' boundaries
// included), in slices issued between the rows: either product whole would fill the reorder
// buffer and stall the softmax behind it. o of block t - 1's group sits in tiles 0-3.
void run_blocks(const Group* gs, int64_t count, AmxBuffers& buf, const uint16_t* kp, const uint16_t* vp, int64_t Dp,
                int64_t cols) {
    struct Pos { int64_t a, j; };  // group gs[a], its block j; a == count: past the end
    auto next = [&](Pos x) { return x.j + 1 < gs[x.a].blocks() ? Pos{x.a, x.j + 1} : Pos{x.a + 1, 0}; };
    buf.cur = 0;
    o_tiles(false, gs[0].o(cols), cols);  // zeros
    ScoreTiles scores;
    scores.issue(gs[0].q, Dp, kp, gs[0].key0(0), 0, gs[0].width(0) / 16, buf.s);
    scores.flush();
    Pos prev{-1, 0};
    for (Pos cur{0, 0}; cur.a < count; prev = cur, cur = next(cur)) {
        const Pos after = next(cur);
        const Group& g = gs[cur.a];
        const int64_t steps = prev.a >= 0 ? gs[prev.a].width(prev.j) / 32 : 0;
        const int64_t pairs = after.a < count ? gs[after.a].width(after.j) / 32 : 0;
        const bool whole = g.whole(cur.j);
        float alpha[TR];
        bool rescale = false;
        for (int64_t i = 0; i < TR; ++i) {
            if (i < g.nr) rescale |= (alpha[i] = g.softmax(i, cur.j, buf.s + buf.cur, buf.p + buf.cur, whole)) != 1.f;
            if (steps)
                pv_steps(buf.p + buf.other(), vp, cols, gs[prev.a].key0(prev.j), steps * i / TR, steps * (i + 1) / TR);
            if (pairs)
                scores.issue(gs[after.a].q, Dp, kp, gs[after.a].key0(after.j), 2 * (pairs * i / TR),
                             2 * (pairs * (i + 1) / TR), buf.s + buf.other());
        }
        scores.flush();  // block t + 1's scores complete
        if (steps) pv_memory(buf.p + buf.other(), vp, cols, gs[prev.a].key0(prev.j), gs[prev.a].width(prev.j),
                             gs[prev.a].o(cols));
        if (prev.a >= 0 && prev.a != cur.a) {  // the previous group is done: its o out, this one's (zeros) in
            o_tiles(true, gs[prev.a].o(cols), cols);
            o_tiles(false, g.o(cols), cols);
        } else if (rescale) {  // o so far (block t - 1's products included) rescaled before block t's
            o_tiles(true, g.o(cols), cols);
            g.rescale(alpha, cols);
            o_tiles(false, g.o(cols), cols);
        }
        buf.cur = buf.other();
    }
    const Group& last = gs[prev.a];
    pv_steps(buf.p + buf.other(), vp, cols, last.key0(prev.j), 0, last.width(prev.j) / 32);
    pv_memory(buf.p + buf.other(), vp, cols, last.key0(prev.j), last.width(prev.j), last.o(cols));
    o_tiles(true, last.o(cols), cols);
}

// Work item (b, K/V head kvh, query positions [p0, p1)) on the packed K (kp) and V (vp) of (b, kvh).
void run_item(const Problem& P, AmxBuffers& buf, const uint16_t* kp, const uint16_t* vp, int64_t b, int64_t kvh,
              int64_t p0, int64_t p1, int64_t qt_pad) {
    const int64_t G = P.H / P.Hkv, rows = p1 - p0, Dp = (P.D + 31) / 32 * 32, cols = (P.Dv + 15) / 16;
    for (int64_t g = 0; g < G; ++g) {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(P.q) + b * P.qs[0] + (kvh * G + g) * P.qs[1];
        uint16_t* dst = buf.q + g * qt_pad * Dp;
        std::memset(dst, 0, sizeof(uint16_t) * qt_pad * Dp);
        for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * Dp, src + (p0 + r) * P.qs[2], 2 * P.D);
    }
    for (int64_t r = 0; r < G * qt_pad; ++r) { buf.m[r] = NEG_INF; buf.l[r] = buf.lx[r] = 0.f; }
    std::memset(buf.o, 0, sizeof(float) * G * qt_pad * cols * 16);
    int64_t panels = 0, count = 0;
    for (int64_t g = 0; g < G; ++g)
        for (int64_t r0 = 0; r0 < rows; r0 += TR) {
            const int64_t row0 = g * qt_pad + r0, nr = std::min(TR, rows - r0);
            int64_t lo, hi;  // keys these rows may see
            key_range(P, p0 + r0, p0 + r0 + nr, lo, hi, b);
            lo = lo / 32 * 32;
            if (hi <= lo) continue;  // o stays 0, m -inf: zeros out
            panels += (hi - lo + NR - 1) / NR;
            buf.groups[count++] = Group{&P, &buf, buf.q + row0 * Dp, b, kvh * G + g, p0 + r0, nr, row0, lo, hi,
                                        P.softcap > 0.f || P.alibi || !(P.scale > 0.f)};
        }
    if (count) run_blocks(buf.groups, count, buf, kp, vp, Dp, cols);
    if (P.panels) {
#pragma omp atomic
        *P.panels += panels;
    }
    for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        bf16* ob = reinterpret_cast<bf16*>(P.out) + b * P.os[0] + h * P.os[1];
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t row = g * qt_pad + r;
            const float inv = row_scale(P, h, buf.m[row], buf.l[row]);
            store_lse(P, b, h, p0 + r, buf.m[row], buf.lx[row]);
            const float* src = buf.o + row * cols * 16;
            for (int64_t t = 0; t < P.Dv; ++t) ob[(p0 + r) * P.os[2] + t] = from_f32<bf16>(src[t] * inv);
        }
    }
}

// K and V of (b, K/V head) bh packed for the tiles (keys [32u0, 32u1)).
void pack(const Problem& P, int64_t bh, int64_t u0, int64_t u1, int64_t Dp, int64_t Dvp, uint16_t* kp, uint16_t* vp) {
    const int64_t b = bh / P.Hkv, kvh = bh % P.Hkv;
    const uint16_t *k = reinterpret_cast<const uint16_t*>(P.k) + b * P.ks[0] + kvh * P.ks[1],
                   *v = reinterpret_cast<const uint16_t*>(P.v) + b * P.vs[0] + kvh * P.vs[1];
    for (int64_t u = u0; u < u1; ++u) {
        pack_k(P, k, u, Dp, kp);
        pack_v(P, v, u, Dvp, vp);
    }
}

// Whether every value of V (bfloat16, (B, Hkv, Sk, Dv) at strides vs) is finite: no exponent of all ones.
bool values_finite(const Problem& P) {
    const uint16_t* v = reinterpret_cast<const uint16_t*>(P.v);
    for (int64_t b = 0; b < P.B; ++b)
        for (int64_t h = 0; h < P.Hkv; ++h)
            for (int64_t j = 0; j < P.Sk; ++j) {
                const uint16_t* row = v + b * P.vs[0] + h * P.vs[1] + j * P.vs[2];
                int nonfinite = 0;  // or-ed over the row (no branch: the loop vectorizes)
                for (int64_t t = 0; t < P.Dv; ++t) nonfinite |= (row[t] & 0x7F80) == 0x7F80;
                if (nonfinite) return false;
            }
    return true;
}

}  // namespace

// Packed sequences: a row group of TR rows may straddle two sequences and the tiles read whole
// blocks of 32 keys, so keys of another sequence are weighed by p = 0 in p · v, and 0 · NaN (or
// inf) is NaN. The AVX-512 loop ends each row group where its sequence does and reads only its
// keys (attention.cpp): packed calls whose V holds a value that is not finite run there instead,
// so a NaN or inf in one sequence never reaches another's rows (the scan reads V once: O(Sk · Dv)
// against the loop's O(Sq · Sk · D)). A NaN or inf in K needs no such care: masking sets the
// scores of another sequence's keys to -inf whatever they were.
bool amx_takes(const Problem& P) {
    return amx_switch.load() && P.Sk > 0 && amx_permitted() && (!P.seg || values_finite(P));
}

// Work shared out two ways. With enough (b, K/V head) pairs for the threads, each thread takes
// whole pairs, packs their K and V itself just before it uses them (then still in its L2: 0.94-
// 0.95× the time of packing them all first, S = 1024..2048, H = 12), one pair after another;
// otherwise all threads pack every pair first, then take work items (pair, query tile) one at a
// time.
int attention_amx(const Problem& P, int64_t query_tile, int threads) {
    const int64_t G = P.H / P.Hkv, Dp = (P.D + 31) / 32 * 32, Dvp = (P.Dv + 15) / 16 * 16;
    const int64_t Skp = (P.Sk + 31) / 32 * 32, heads = P.B * P.Hkv;
    const int64_t qt = std::min(query_tile, std::max<int64_t>(P.Sq, 1));
    const int64_t tiles = (P.Sq + qt - 1) / qt, items = heads * tiles, qt_pad = (qt + TR - 1) / TR * TR;
    const bool own = whole_pairs(heads, threads);
    const int64_t packed = own ? threads : heads;  // K, V packs: one per thread, or one per pair
    uint16_t *kp = alloc16(packed * Skp * Dp), *vp = alloc16(packed * Skp * Dvp);
    if (!kp || !vp) {
        std::free(kp);
        std::free(vp);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const FlushToZero ftz;  // this thread, for the loop (restored as it ends)
        const TileConfig config;
        _tile_loadconfig(&config);
        AmxBuffers buf{alloc16(G * qt_pad * Dp), alloc(2 * TR * KB), alloc16(2 * TR * KB),
                       alloc(G * qt_pad * Dvp), alloc(G * qt_pad), alloc(G * qt_pad), alloc(G * qt_pad),
                       static_cast<Group*>(std::malloc(sizeof(Group) * (G * qt_pad / TR)))};
        if (!buf.ok()) {
#pragma omp atomic write
            failed = 1;
        } else {  // rows past a tile's last query are multiplied too (and never read): no stale NaN there
            std::memset(buf.p, 0, sizeof(uint16_t) * 2 * TR * KB);
        }
        if (own) {
            const int64_t me = omp_get_thread_num();
            uint16_t *mk = kp + me * Skp * Dp, *mv = vp + me * Skp * Dvp;
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < heads; ++bh) {
                if (!buf.ok()) continue;
                pack(P, bh, 0, Skp / 32, Dp, Dvp, mk, mv);
                for (int64_t tile = tiles - 1; tile >= 0; --tile)
                    run_item(P, buf, mk, mv, bh / P.Hkv, bh % P.Hkv, tile * qt, std::min(tile * qt + qt, P.Sq),
                             qt_pad);
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t it = 0; it < heads * (Skp / 32); ++it) {
                const int64_t bh = it / (Skp / 32), u = it % (Skp / 32);
                pack(P, bh, u, u + 1, Dp, Dvp, kp + bh * Skp * Dp, vp + bh * Skp * Dvp);
            }  // (a barrier)
            if (!failed) {
                // Later query tiles see more keys under a causal mask: hand them out first.
#pragma omp for schedule(dynamic, 1)
                for (int64_t it = 0; it < items; ++it) {
                    const int64_t tile = tiles - 1 - it % tiles, bh = it / tiles;
                    const int64_t p0 = tile * qt, p1 = std::min(p0 + qt, P.Sq);
                    run_item(P, buf, kp + bh * Skp * Dp, vp + bh * Skp * Dvp, bh / P.Hkv, bh % P.Hkv, p0, p1,
                             qt_pad);
                }
            }
        }
        buf.release();
        _tile_release();
    }
    std::free(kp);
    std::free(vp);
    return failed ? -1 : 0;
}

#else  // no AMX in this build

bool amx_takes(const Problem&) { return false; }
int attention_amx(const Problem&, int64_t, int) { return -2; }

#endif

}  // namespace mh

// Whether mh_attention_bf16 runs its AMX loop now: built with AMX, permitted by the kernel,
// switched on; 1 or 0.
extern "C" int mh_amx_ready() {
#if MH_AMX
    return mh::amx_switch.load() && mh::amx_permitted();
#else
    return 0;
#endif
}

// Switches the AMX loop on (1) or off (0: mh_attention_bf16 runs the AVX-512 loop, as without
// AMX; the tests' fallback) for the process; returns the switch's previous position.
extern "C" int mh_amx_switch(int on) { return mh::amx_switch.exchange(on != 0); }
