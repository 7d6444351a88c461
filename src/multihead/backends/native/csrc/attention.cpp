// multihead's native CPU attention kernel: forward only, FlashAttention-style; q, k, v and
// out float32 (mh_attention_f32), bfloat16 (mh_attention_bf16) or float16 (mh_attention_f16),
// computed in float32 (see "Half precision storage" in common.h).
//
// Notation: B batch, H query heads, Hkv key/value heads, G = H / Hkv query heads per
// K/V head, Sq queries, Sk keys, D head dim, Dv value head dim. Query i sits at key
// position i + (Sk - Sq) (bottom-right alignment, as everywhere in multihead).
//
// Why it exists: torch's CPU SDPA does its GEMMs through MKL, which runs AVX2 code on
// AMD CPUs, and with a causal mask computes whole 512-key blocks it then masks. Here
// the two products run in register tiles sized for the machine's vectors (GCC vector
// extensions, compiled with -march=native on the user's machine: see common.h), key
// panels of NR (32 with AVX-512, 16 with AVX2) above the diagonal are skipped, and the
// softmax is fused in between, so no S×S matrix ever exists.
//
// Work item = (b, K/V head, tile of QT query positions), shared out dynamically across
// OpenMP threads (torch's own libgomp: it is loaded before this library); or, with enough
// (b, K/V head) pairs for the threads and their packed K within OWN_K_BYTES, each thread takes
// whole pairs, packs a pair's K once and runs its items one after another (0.94-0.96× the
// time, float32, S = 512..4096). An item
//
//   packs its G heads' queries (the scale applied to the scores)      (G, QT, D) float32
//   for each chunk of KC keys its rows may see:
//       packs K of the chunk as panels of NR keys, (D, NR) each         (kt) float32
//           (or finds it packed: the pair's K, packed whole by its thread)
//       for each head, for each MR query rows:
//           s = (q · kᵀ)·scale·log2(e)  over the panels some row may see (MR × NR tiles)
//           -inf where causal / window / the caller's mask / padding forbid
//           online softmax (base 2): m' = max(m, max s); o *= 2^(m - m'); l *= 2^(m - m')
//           p = 2^(s - m'); l += Σp; o += p · v      (MR_PV × Dv tiles, V read in place,
//                                                      widened to float32 as loaded)
//   writes o / l in the output's type (zeros where l == 0: a query with no allowed key).
//
// Half precision is widened where it is read (Q and K while packed, V in the p·v tiles)
// and rounded to nearest even where out is written; lse is float32 for every type.
//
// Returns 0, or a negative code: -1 out of memory, -2 unsupported shape.

#include "common.h"
#include "kernels.h"

#include <type_traits>

namespace {

using namespace mh;

// One panel (D, NR) of keys [first, first + NR) of K (rows kb, stride ks[2]): dst[t·NR + j] =
// K[first + j][t], zero past Sk; W × W blocks transposed in registers where D allows (half
// precision widened to float32 first, W × W values at a time). With AVX-512 the scalar loop
// below took 14% of the float32 forward's time (S = 2048, H = 12, D = 64; perf, Intel Xeon).
template <class T>
inline void pack_panel(const Problem& P, const T* kb, int64_t first, float* __restrict dst) {
    const int64_t D = P.D;
#if (MH_VECTOR_FLOATS == 8 && defined(__AVX__)) || MH_VECTOR_FLOATS == 16
    if (D % W == 0 && first + NR <= P.Sk) {
        alignas(64) float wide[W][W];
        for (int64_t j = 0; j < NR; j += W) {
            for (int64_t t = 0; t < D; t += W) {
                const float* rows[W];
                for (int c = 0; c < W; ++c) {
                    const T* src = kb + (first + j + c) * P.ks[2] + t;
                    if constexpr (std::is_same_v<T, float>) {
                        rows[c] = src;
                    } else {
                        store(wide[c], load_f(src));
                        rows[c] = wide[c];
                    }
                }
#if MH_VECTOR_FLOATS == 16
                transpose16(rows, dst + t * NR + j);
#else
                transpose8(rows, dst + t * NR + j);
#endif
            }
        }
        return;
    }
#endif
    for (int64_t j = 0; j < NR; ++j) {
        const int64_t key = first + j;
        for (int64_t t = 0; t < D; ++t) dst[t * NR + j] = key < P.Sk ? to_f32(kb[key * P.ks[2] + t]) : 0.f;
    }
}

// The most bytes of one (b, K/V head)'s packed K for a thread to pack it whole (L2: 2 MiB here).
constexpr int64_t OWN_K_BYTES = 1 << 20;

// With a block mask: the tiles' classes of rows [i0, i0 + nr) for key block kb: whether any
// of them may attend (else the block is skipped) and whether all are FULL (no mask to read).
inline void block_class(const Problem& P, int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t kb, bool& any,
                        bool& full) {
    any = false;
    full = true;
    for (int64_t qb = i0 / P.bq; qb <= (i0 + nr - 1) / P.bq; ++qb) {
        const int32_t t = tile_at(P, b, h, qb, kb);
        any |= t != TILE_EMPTY;
        full &= t == TILE_FULL;
    }
}

// Bytes [c0, c1) of a partial tile's row that may attend (c0 = c1 = 0 when none): read 8 at a time
// (n, the tile's width, is a multiple of 32).
inline void allowed_span(const uint8_t* row, int64_t n, int64_t& c0, int64_t& c1) {
    int64_t w0 = 0, w1 = n / 8;
    uint64_t first = 0, last = 0;
    for (; w0 < w1; ++w0) {
        std::memcpy(&first, row + 8 * w0, 8);
        if (first) break;
    }
    if (w0 == w1) { c0 = c1 = 0; return; }
    for (; w1 > w0; --w1) {
        std::memcpy(&last, row + 8 * (w1 - 1), 8);
        if (last) break;
    }
    c0 = 8 * w0 + __builtin_ctzll(first) / 8;  // little endian: the lowest set byte comes first
    c1 = 8 * (w1 - 1) + (63 - __builtin_clzll(last)) / 8 + 1;
}

// The keys [lo, hi) of key block kb (within [a, e), panel aligned) that some row of [i0, i0 + nr)
// may see: a FULL tile's whole block, a partial tile's row's allowed bytes. lo >= hi: none.
inline void tile_hull(const Problem& P, int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t kb, int64_t a,
                      int64_t e, int64_t& lo, int64_t& hi) {
    lo = e;
    hi = a;
    for (int64_t i = i0; i < i0 + nr && (lo > a || hi < e); ++i) {
        const int32_t t = tile_at(P, b, h, i / P.bq, kb);
        if (t == TILE_EMPTY) continue;
        int64_t c0 = 0, c1 = P.bk;
        if (t != TILE_FULL) allowed_span(P.partial + (int64_t(t) * P.bq + i % P.bq) * P.bk, P.bk, c0, c1);
        if (c1 <= c0) continue;
        lo = std::min(lo, kb * P.bk + c0);
        hi = std::max(hi, kb * P.bk + c1);
    }
    lo = std::max(a, lo / NR * NR);
    hi = std::min(e, (hi + NR - 1) / NR * NR);
}

// With a block mask: the rows [i0, i0 + nr) of head h (their packed queries at row qrow of
// buf.qbuf, their running state at row srow) against keys [j0, j1) (panel aligned; kt: the
// packed panel of key j0 and those after it). Key blocks whose tiles are all EMPTY for these
// rows are skipped (no product), consecutive all-FULL blocks run as one segment without a
// mask, any other block alone with each row's bytes (a row whose tile is EMPTY reads zeros),
// over the panels the rows' allowed bytes reach (a causal or windowed edge's triangle: half the
// panels of a diagonal tile on average). Returns the q·kᵀ panels computed.
template <class T>
int64_t tiled_rows(const Problem& P, Buffers& buf, const float* kt, int64_t j0, int64_t j1, int64_t b, int64_t h,
                   int64_t qrow, int64_t srow, int64_t i0, int64_t nr, const T* vb) {
    static const uint8_t zeros[MAX_BLOCK_KEYS] = {};
    const int64_t D = P.D, Dv = P.Dv, off = P.Sk - P.Sq;
    int64_t panels = 0;
    for (int64_t a = j0; a < j1;) {
        const int64_t kb = a / P.bk;
        int64_t e = std::min(j1, (kb + 1) * P.bk);
        bool any, full;
        block_class(P, b, h, i0, nr, kb, any, full);
        if (!any) { a = e; continue; }
        while (full && e < j1) {  // join the next blocks while they are FULL for every row too
            bool any2, full2;
            block_class(P, b, h, i0, nr, e / P.bk, any2, full2);
            if (!full2) break;
            e = std::min(j1, e + P.bk);
        }
        const int64_t block_end = e;
        if (!full) {  // one block with partial tiles: only the panels its rows' allowed keys reach
            int64_t lo, hi;
            tile_hull(P, b, h, i0, nr, kb, a, e, lo, hi);
            if (hi <= lo) { a = block_end; continue; }
            a = lo;
            e = hi;
        }
        const int64_t width = e - a, valid = std::min(e, P.Sk) - a;
        float* s = buf.s;  // (MR, KC)
        for (int64_t pan = 0; pan < width / NR; ++pan)
            qk_tile(buf.qbuf + qrow * D, D, D, kt + ((a - j0) / NR + pan) * D * NR, s + pan * NR, KC, P.scale);
        panels += width / NR;
        for (int64_t i = 0; i < nr; ++i) {
            const int64_t qi = i0 + i;
            const uint8_t* mrow = nullptr;
            if (!full) {
                const int32_t t = tile_at(P, b, h, qi / P.bq, kb);
                mrow = t == TILE_FULL ? nullptr
                       : t == TILE_EMPTY ? zeros
                       : P.partial + (int64_t(t) * P.bq + qi % P.bq) * P.bk;
            }
            const int64_t row = srow + i;
            row_update(P, s + i * KC, width, valid, a, qi + off, mrow, buf.m[row], buf.l[row], buf.o + row * Dv, b,
                       h, kb * P.bk);
        }
        pv(s, KC, nr, valid, vb + a * P.vs[2], P.vs[2], buf.o + srow * Dv, Dv, Dv);
        a = block_end;
    }
    return panels;
}

// T: the element type of q, k, v and out (float, bf16 or f16); P's pointers hold T data.
// kt_head: null, or K of (b, kvh) packed whole (its panels in order): no packing per chunk.
template <class T>
void run_item(const Problem& P, Buffers& buf, int64_t b, int64_t kvh, int64_t p0, int64_t p1, int64_t qt_pad,
              const float* kt_head = nullptr) {
    const int64_t G = P.H / P.Hkv, D = P.D, Dv = P.Dv, rows = p1 - p0;
    const int64_t off = P.Sk - P.Sq;
    const T *q = reinterpret_cast<const T*>(P.q), *k = reinterpret_cast<const T*>(P.k);
    const T* v = reinterpret_cast<const T*>(P.v);
    // Queries of the G heads, unscaled (qk_tile scales the scores): (G, qt_pad, D), padding rows zero.
    for (int64_t g = 0; g < G; ++g) {
        const T* src = q + b * P.qs[0] + (kvh * G + g) * P.qs[1];
        float* dst = buf.qbuf + g * qt_pad * D;
        for (int64_t r = 0; r < qt_pad; ++r) {
            if (r < rows) {
                const T* qr = src + (p0 + r) * P.qs[2];
                for (int64_t t = 0; t < D; ++t) dst[r * D + t] = to_f32(qr[t]);
            } else {
                std::memset(dst + r * D, 0, sizeof(float) * D);
            }
        }
    }
    for (int64_t r = 0; r < G * rows; ++r) { buf.m[r] = NEG_INF; buf.l[r] = 0.f; }
    std::memset(buf.o, 0, sizeof(float) * G * rows * Dv);

    int64_t lo, hi;
    key_range(P, p0, p1, lo, hi, b);
    int64_t panels = 0;  // q·kᵀ key panels computed (P.panels)
    lo = lo / NR * NR;  // panel aligned
    const T* kb = k + b * P.ks[0] + kvh * P.ks[1];
    const T* vb = v + b * P.vs[0] + kvh * P.vs[1];
    for (int64_t c0 = lo; c0 < hi; c0 += KC) {
        const int64_t c1 = std::min(c0 + KC, hi);
        const int64_t npan = (c1 - c0 + NR - 1) / NR;
        // Pack K[c0, c1) as panels (D, NR): kt[pan][t][j] = K[c0 + NR·pan + j][t]; zero past Sk.
        const float* kt = kt_head ? kt_head + c0 / NR * D * NR : buf.kt;
        if (!kt_head)
            for (int64_t pan = 0; pan < npan; ++pan) pack_panel(P, kb, c0 + pan * NR, buf.kt + pan * D * NR);
        for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kvh * G + g;
            for (int64_t r0 = 0, nr; r0 < rows; r0 += nr) {
                nr = std::min<int64_t>(MR, rows - r0);
                // With a block mask, a group of rows ends where its query block does: a group across
                // two blocks would compute the union of their live tiles (90% empty tiles, S = 2048:
                // 0.203× the time of every tile full, 0.19× so; Intel Xeon, AVX-512).
                if (P.tiles) nr = std::min(nr, P.bq - (p0 + r0) % P.bq);
                // Packed sequences: a group of rows ends where its sequence does, so that its keys
                // (and the values p · v reads) are its own sequence's only: a NaN or inf in another
                // sequence never reaches it (0 · NaN is NaN).
                if (P.seg) nr = std::clamp<int64_t>(P.seg[b * P.seg_bs + P.Sk + p0 + r0] - (p0 + r0), 1, nr);
                int64_t blo, bhi;  // keys these rows may see
                key_range(P, p0 + r0, p0 + r0 + nr, blo, bhi, b);
                blo = std::max(blo, c0);
                bhi = std::min(bhi, c1);
                if (bhi <= blo) continue;
                const int64_t pa = (blo - c0) / NR, pb = (bhi - c0 + NR - 1) / NR;
                if (P.tiles) {
                    panels += tiled_rows(P, buf, kt + pa * D * NR, c0 + pa * NR, c0 + pb * NR, b, h, g * qt_pad + r0,
                                         g * rows + r0, p0 + r0, nr, vb);
                    continue;
                }
                const int64_t j0 = c0 + pa * NR, width = (pb - pa) * NR;  // score columns [j0, j0 + width)
                float* s = buf.s;  // (MR, KC)
                panels += pb - pa;
                for (int64_t pan = pa; pan < pb; ++pan)
                    qk_tile(buf.qbuf + (g * qt_pad + r0) * D, D, D, kt + pan * D * NR, s + (pan - pa) * NR, KC, P.scale);
                const int64_t valid = std::min(j0 + width, P.Sk) - j0;  // columns that are real keys
                for (int64_t i = 0; i < nr; ++i) {
                    const uint8_t* mrow = P.mask ? P.mask + b * P.ms[0] + h * P.ms[1] + (p0 + r0 + i) * P.ms[2] : nullptr;
                    const int64_t row = g * rows + r0 + i;
                    row_update(P, s + i * KC, width, valid, j0, p0 + r0 + i + off, mrow, buf.m[row], buf.l[row],
                               buf.o + row * Dv, b, h);
                }
                // p · v over the rows' keys: the panels' columns, or with packed sequences exactly
                // the rows' own keys [blo, bhi) (the panels' other columns are another sequence's)
                const int64_t v0 = P.seg ? blo - j0 : 0, nv = P.seg ? bhi - blo : valid;
                pv(s + v0, KC, nr, nv, vb + (j0 + v0) * P.vs[2], P.vs[2], buf.o + (g * rows + r0) * Dv, Dv, Dv);
            }
        }
    }
    if (P.panels) {
#pragma omp atomic
        *P.panels += panels;
    }
    for (int64_t g = 0; g < G; ++g) {
        T* ob = reinterpret_cast<T*>(P.out) + b * P.os[0] + (kvh * G + g) * P.os[1];
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t row = g * rows + r;
            const float inv = row_scale(P, kvh * G + g, buf.m[row], buf.l[row]);
            store_lse(P, b, kvh * G + g, p0 + r, buf.m[row], buf.l[row]);
            const float* src = buf.o + row * Dv;
            T* dst = ob + (p0 + r) * P.os[2];
            for (int64_t t = 0; t < Dv; ++t) dst[t] = from_f32<T>(src[t] * inv);
        }
    }
}

// The entry points' body for element type T (q, k, v, out; lse is float32): P's pointers
// are typed float but hold T data, read through run_item<T>.
template <class T>
int attention(const void* q, const void* k, const void* v, void* out, float* lse, const uint8_t* mask,
              const int64_t* dims, const int64_t* strides, float scale, int causal, int64_t window, float softcap,
              const float* alibi, const float* sinks, const int64_t* seg, int64_t seg_bs, int64_t* panels,
              const int32_t* tile_class, const int64_t* tile_info, const uint8_t* partial, const float* bias,
              const int64_t* bias_strides, int64_t query_tile, int threads) {
    Problem P = make_problem(static_cast<const float*>(q), static_cast<const float*>(k),
                             static_cast<const float*>(v), static_cast<float*>(out), lse, mask, dims, strides,
                             scale, causal, window);
    P.softcap = softcap > 0.f ? softcap * 1.4426950408889634f : 0.f;
    P.alibi = alibi; P.sinks = sinks; P.seg = seg; P.seg_bs = seg_bs; P.panels = panels;
    if (seg && P.Sq != P.Sk) return -2;
    if (bias) {  // an additive bias: its strides (b, h, i, j)
        if (!bias_strides) return -2;
        P.bias = bias;
        for (int i = 0; i < 4; ++i) P.bs[i] = bias_strides[i];
    }
    if (tile_class) {  // a block mask: its strides, block sizes, and its tiles' bytes (see Problem)
        if (!set_block_mask(P, tile_class, tile_info, partial, mask)) return -2;
        P.ms[3] = 1;  // a tile's row of bytes is contiguous
    }
    if (!valid(P) || query_tile <= 0) return -2;
    if constexpr (std::is_same_v<T, float>)
        if (lanes_take(P)) return lanes_attention(P, threads);  // few keys: the rows in the vector lanes
    if constexpr (std::is_same_v<T, bf16>)
        if (!P.tiles && !P.bias && amx_takes(P)) return attention_amx(P, query_tile, threads);
    const int64_t G = P.H / P.Hkv;
    const int64_t qt = std::min(query_tile, std::max<int64_t>(P.Sq, 1));
    const int64_t tiles = (P.Sq + qt - 1) / qt;
    const int64_t items = P.B * P.Hkv * tiles;
    // Rows of packed queries per head: the tile rounded up to MR; with a block mask or packed
    // sequences, MR more (zeros), because its row groups end at query blocks or sequences and may
    // then start at any row (qk_tile reads MR).
    const int64_t qt_pad = (qt + MR - 1) / MR * MR + (P.tiles || P.seg ? MR : 0);
    // With enough (b, K/V head) pairs for the threads and K small enough to stay in L2 once packed,
    // each thread takes whole pairs and packs each one's K once (not once per query tile). The
    // pairs are handed out one at a time, not in fixed shares: beside a process competing for the
    // cores, a thread the OS deschedules then holds up fewer of them (Qwen3's 8 pairs, S = 512,
    // D = 128, 2 threads on the AMD EPYC: 11.8-15.4 ms against 18.8-22.3 with fixed shares, idle
    // 9.3-9.5 ms either way; three runs). A pair is computed whole by one thread: the same bits.
    const int64_t heads = P.B * P.Hkv, kpanels = (P.Sk + NR - 1) / NR;
    const bool own = whole_pairs(heads, threads) && kpanels * NR * P.D * 4 <= OWN_K_BYTES;
    float* own_kt = own ? alloc(threads * kpanels * P.D * NR) : nullptr;
    if (own && !own_kt) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const FlushToZero ftz;  // this thread, for the loop (restored as it ends)
        Buffers buf{alloc(G * qt_pad * P.D), alloc(KC * P.D), alloc(MR * KC), alloc(G * qt), alloc(G * qt),
                    alloc(G * qt * P.Dv)};
        if (!buf.ok()) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed && own) {
            float* kt = own_kt + omp_get_thread_num() * kpanels * P.D * NR;
#pragma omp for schedule(dynamic, 1)
            for (int64_t bh = 0; bh < heads; ++bh) {
                const T* kb = static_cast<const T*>(static_cast<const void*>(P.k)) + bh / P.Hkv * P.ks[0] +
                              bh % P.Hkv * P.ks[1];
                for (int64_t pan = 0; pan < kpanels; ++pan) pack_panel(P, kb, pan * NR, kt + pan * P.D * NR);
                for (int64_t tile = tiles - 1; tile >= 0; --tile)
                    run_item<T>(P, buf, bh / P.Hkv, bh % P.Hkv, tile * qt, std::min(tile * qt + qt, P.Sq), qt_pad, kt);
            }
        } else if (!failed) {
            // Later query tiles see more keys under a causal mask: hand them out first.
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; ++it) {
                const int64_t tile = tiles - 1 - it % tiles, rest = it / tiles;
                const int64_t kvh = rest % P.Hkv, b = rest / P.Hkv;
                const int64_t p0 = tile * qt, p1 = std::min(p0 + qt, P.Sq);
                run_item<T>(P, buf, b, kvh, p0, p1, qt_pad);
            }
        }
        buf.release();
    }
    std::free(own_kt);
    return failed ? -1 : 0;
}

}  // namespace

// q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv) -> out (B, H, Sq, Dv); strides:
// q, k, v, out (b, h, s), mask (b, h, i, j), then lse (b, h, s), in elements; last dims contiguous;
// lse (B, H, Sq) may be null. The logit features (multihead.logits; each off when 0 / null):
// softcap (natural units), alibi (H,) slopes, sinks (H,) logits (lse leaves the sink out,
// as the torch backends' does), seg (B|1, 2, Sk) int64 [start, end) of each key position's
// packed sequence (Sq == Sk), seg_bs its batch stride; panels: null or a counter the
// kernel adds the q·kᵀ key panels it computed to. tiles: null, or a block mask's int32
// classes (B|1, H|1, ceil(Sq/bq), ceil(Sk/bk)) (-1 empty: skipped, -2 full: no mask read, p >= 0:
// the tile's bq × bk bytes at partial + p·bq·bk), tile_info its 4 strides then bq, bk (bk a
// multiple of the panel width, at most 1024); mask must then be null.
extern "C" int mh_attention_f32(const float* q, const float* k, const float* v, float* out, float* lse,
                                const uint8_t* mask, const int64_t* dims, const int64_t* strides, float scale,
                                int causal, int64_t window, float softcap, const float* alibi, const float* sinks,
                                const int64_t* seg, int64_t seg_bs, int64_t* panels, const int32_t* tiles,
                                const int64_t* tile_info, const uint8_t* partial,
                                const float* bias, const int64_t* bias_strides, int64_t query_tile,
                                int threads) {
    return attention<float>(q, k, v, out, lse, mask, dims, strides, scale, causal, window, softcap, alibi, sinks,
                            seg, seg_bs, panels, tiles, tile_info, partial, bias, bias_strides, query_tile, threads);
}

// As mh_attention_f32 with q, k, v and out bfloat16 (uint16 bits); lse, alibi, sinks float32.
extern "C" int mh_attention_bf16(const void* q, const void* k, const void* v, void* out, float* lse,
                                 const uint8_t* mask, const int64_t* dims, const int64_t* strides, float scale,
                                 int causal, int64_t window, float softcap, const float* alibi, const float* sinks,
                                 const int64_t* seg, int64_t seg_bs, int64_t* panels, const int32_t* tiles,
                                const int64_t* tile_info, const uint8_t* partial,
                                const float* bias, const int64_t* bias_strides, int64_t query_tile,
                                 int threads) {
    return attention<bf16>(q, k, v, out, lse, mask, dims, strides, scale, causal, window, softcap, alibi, sinks,
                           seg, seg_bs, panels, tiles, tile_info, partial, bias, bias_strides, query_tile, threads);
}

// As mh_attention_f32 with q, k, v and out float16 (uint16 bits); lse, alibi, sinks float32.
extern "C" int mh_attention_f16(const void* q, const void* k, const void* v, void* out, float* lse,
                                const uint8_t* mask, const int64_t* dims, const int64_t* strides, float scale,
                                int causal, int64_t window, float softcap, const float* alibi, const float* sinks,
                                const int64_t* seg, int64_t seg_bs, int64_t* panels, const int32_t* tiles,
                                const int64_t* tile_info, const uint8_t* partial,
                                const float* bias, const int64_t* bias_strides, int64_t query_tile,
                                int threads) {
    return attention<f16>(q, k, v, out, lse, mask, dims, strides, scale, causal, window, softcap, alibi, sinks,
                          seg, seg_bs, panels, tiles, tile_info, partial, bias, bias_strides, query_tile, threads);
}

// The scalar conversions of common.h (the whole conversion where a build has no AVX2 or
// F16C; the tails of rows otherwise), for the tests: n values of src to dst. kind 0 bfloat16,
// 1 float16; to_half 1: float32 -> half (round to nearest even), 0: half -> float32.
extern "C" int mh_convert_scalar(int kind, int to_half, const void* src, void* dst, int64_t n) {
    if ((kind != 0 && kind != 1) || n < 0) return -2;
    const float* f = static_cast<const float*>(src);
    const uint16_t* h = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) {
        if (to_half)
            static_cast<uint16_t*>(dst)[i] = kind ? from_f32<f16>(f[i]).bits : from_f32<bf16>(f[i]).bits;
        else
            static_cast<float*>(dst)[i] = kind ? to_f32(f16{h[i]}) : to_f32(bf16{h[i]});
    }
    return 0;
}


// The vector width the kernels were compiled for (-march=native): 512 with AVX-512,
// 256 with AVX2 (each with its own register tiles: common.h), 128 otherwise (the AVX2
// tiles, split by the compiler; not measured).
extern "C" int mh_vector_bits() {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 128;
#endif
}
