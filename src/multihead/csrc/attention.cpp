// multihead's native CPU attention kernel: float32, forward only, FlashAttention-style.
//
// Notation: B batch, H query heads, Hkv key/value heads, G = H / Hkv query heads per
// K/V head, Sq queries, Sk keys, D head dim, Dv value head dim. Query i sits at key
// position i + (Sk - Sq) (bottom-right alignment, as everywhere in multihead).
//
// Why it exists: torch's CPU SDPA does its GEMMs through MKL, which runs AVX2 code on
// AMD CPUs, and with a causal mask computes whole 512-key blocks it then masks. Here
// the two products run in AVX-512 register tiles (GCC vector extensions, compiled with
// -march=native on the user's machine), key tiles of 32 above the diagonal are
// skipped, and the softmax is fused in between, so no S×S matrix ever exists.
//
// Work item = (b, K/V head, tile of QT query positions), shared out dynamically across
// OpenMP threads (torch's own libgomp: it is loaded before this library). An item
//
//   packs its G heads' queries, pre-multiplied by scale·log2(e)       (G, QT, D)
//   for each chunk of KC keys its rows may see:
//       packs K of the chunk as panels of 32 keys, (D, 32) each         (kt)
//       for each head, for each MR query rows:
//           s = q · kᵀ  over the panels some row may see (MR × 32 tiles)
//           -inf where causal / window / the caller's mask / padding forbid
//           online softmax (base 2): m' = max(m, max s); o *= 2^(m - m'); l *= 2^(m - m')
//           p = 2^(s - m'); l += Σp; o += p · v      (MR_PV × Dv tiles, V read in place)
//   writes o / l (zeros where l == 0: a query with no allowed key).
//
// Returns 0, or a negative code: -1 out of memory, -2 unsupported shape.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // unaligned access
typedef int32_t i16 __attribute__((vector_size(64)));

constexpr int64_t NR = 32;   // keys per panel: two vectors
constexpr int MR = 12;       // query rows of a q·kᵀ tile (24 accumulators)
constexpr int MR_PV = 6;     // query rows of a p·v tile (6 × 4 = 24 accumulators)
constexpr int64_t KC = 512;  // keys per chunk (a packed chunk of D = 64 is 128 KiB, L2)
constexpr int64_t KD = 2048;  // keys per chunk of the decoding loop (one long K stream, then V)
constexpr float NEG_INF = -__builtin_inff();

inline v16 load(const float* p) { return *(const v16u*)p; }
inline void store(float* p, v16 x) { *(v16u*)p = x; }
inline v16 splat(float x) { return (v16){} + x; }
inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }

inline float hmax(v16 x) {
    float m = x[0];
    for (int i = 1; i < 16; ++i) m = std::max(m, x[i]);
    return m;
}

inline float hsum(v16 x) {
#ifdef __AVX512F__
    return _mm512_reduce_add_ps((__m512)x);
#else
    float s = 0.f;
    for (int i = 0; i < 16; ++i) s += x[i];
    return s;
#endif
}

// 16 vectors -> one whose lane p is the sum of x[p]'s lanes: four levels of shuffles and
// adds (15 adds) and one permutation, instead of 16 horizontal sums.
inline v16 reduce16(const v16* x) {
#ifdef __AVX512F__
    __m512 b[8], c[4], d[2];
    for (int m = 0; m < 8; ++m) {  // 256-bit halves folded: lanes (x.L0+x.L2, x.L1+x.L3, y.L0+y.L2, y.L1+y.L3)
        __m512 x0 = (__m512)x[2 * m], x1 = (__m512)x[2 * m + 1];
        b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x44), _mm512_shuffle_f32x4(x0, x1, 0xEE));
    }
    for (int m = 0; m < 4; ++m)  // 128-bit lane i: 4 partial sums of x[4m + i]
        c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0xDD));
    for (int m = 0; m < 2; ++m) {  // lane i: 2 partial sums of x[8m + i], then of x[8m + 4 + i]
        __m512d lo = _mm512_unpacklo_pd((__m512d)c[2 * m], (__m512d)c[2 * m + 1]);
        __m512d hi = _mm512_unpackhi_pd((__m512d)c[2 * m], (__m512d)c[2 * m + 1]);
        d[m] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    // Lane q holds the sum of x[q / 4 + 4·(q % 4)]: put x[p]'s sum in lane p.
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return (v16)_mm512_permutexvar_ps(order, r);
#else
    v16 r;
    for (int p = 0; p < 16; ++p) r[p] = hsum(x[p]);
    return r;
#endif
}

// The 16 dot products of q (D) with keys k[0..15] (row stride ldk), D a multiple of 16.
inline v16 dot16(const float* __restrict q, const float* __restrict k, int64_t ldk, int64_t d) {
    v16 acc[16];
#pragma GCC unroll 16
    for (int s = 0; s < 16; ++s) acc[s] = (v16){};
    // Key by key, each row read front to back: the order the hardware prefetcher follows.
#pragma GCC unroll 16
    for (int s = 0; s < 16; ++s)
        for (int64_t t = 0; t < d; t += 16) acc[s] += load(q + t) * load(k + s * ldk + t);
    return reduce16(acc);
}

// Σ a[t]·b[t], vectorised along t.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
    v16 acc = (v16){};
    int64_t t = 0;
    for (; t + 16 <= d; t += 16) acc += load(a + t) * load(b + t);
    float s = hsum(acc);
    for (; t < d; ++t) s += a[t] * b[t];
    return s;
}

// 2^x for x <= 0 (scores minus their row maximum); exactly 0 for x <= -127, so -inf
// (masked) gives 0. 2^x = 2^n · 2^f, n = round(x), f in [-1/2, 1/2], 2^f by its Taylor
// series to degree 7 (relative error < 1e-8, below float32 rounding). NaN stays NaN.
inline v16 exp2v(v16 x) {
    x = x < -127.f ? splat(-127.f) : x;
    const float round = 12582912.f;  // 1.5 · 2^23: adding it rounds to an integer
    v16 n = (x + round) - round;
    v16 f = x - n;
    v16 p = splat(1.525273e-5f);
    p = p * f + 1.540353e-4f;
    p = p * f + 1.333355e-3f;
    p = p * f + 9.618129e-3f;
    p = p * f + 5.550411e-2f;
    p = p * f + 2.402265e-1f;
    p = p * f + 6.931472e-1f;
    p = p * f + 1.f;
    i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;  // 2^n; n = -127 gives +0
    return p * (v16)bits;
}

// c (MR × 32, row stride ldc) = a (MR × d, rows contiguous) · panel (d × 32).
inline void qk_tile(const float* __restrict a, int64_t d, const float* __restrict panel,
                    float* __restrict c, int64_t ldc) {
    v16 c0[MR], c1[MR];
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) c0[i] = c1[i] = (v16){};
    for (int64_t t = 0; t < d; ++t) {
        v16 b0 = load(panel + t * NR), b1 = load(panel + t * NR + 16);
#pragma GCC unroll 12
        for (int i = 0; i < MR; ++i) {
            v16 ai = splat(a[i * d + t]);
            c0[i] += ai * b0;
            c1[i] += ai * b1;
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
        store(c + i * ldc, c0[i]);
        store(c + i * ldc + 16, c1[i]);
    }
}

// o (rows × 16·NV, row stride ldo) += p (rows × n, row stride ldp) · v (n × 16·NV, row stride ldv).
template <int ROWS, int NV>
inline void pv_tile(const float* __restrict p, int64_t ldp, int64_t n, const float* __restrict v,
                    int64_t ldv, float* __restrict o, int64_t ldo) {
    v16 acc[ROWS][NV];
#pragma GCC unroll 6
    for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 4
        for (int t = 0; t < NV; ++t) acc[i][t] = load(o + i * ldo + 16 * t);
    for (int64_t j = 0; j < n; ++j) {
        v16 vj[NV];
#pragma GCC unroll 4
        for (int t = 0; t < NV; ++t) vj[t] = load(v + j * ldv + 16 * t);
#pragma GCC unroll 6
        for (int i = 0; i < ROWS; ++i) {
            v16 pij = splat(p[i * ldp + j]);
#pragma GCC unroll 4
            for (int t = 0; t < NV; ++t) acc[i][t] += pij * vj[t];
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 4
        for (int t = 0; t < NV; ++t) store(o + i * ldo + 16 * t, acc[i][t]);
}

template <int ROWS>
void pv_rows(const float* p, int64_t ldp, int64_t n, const float* v, int64_t ldv, float* o, int64_t ldo,
             int64_t dv) {
    int64_t c = 0;
    for (; c + 64 <= dv; c += 64) pv_tile<ROWS, 4>(p, ldp, n, v + c, ldv, o + c, ldo);
    switch ((dv - c) / 16) {
        case 3: pv_tile<ROWS, 3>(p, ldp, n, v + c, ldv, o + c, ldo); break;
        case 2: pv_tile<ROWS, 2>(p, ldp, n, v + c, ldv, o + c, ldo); break;
        case 1: pv_tile<ROWS, 1>(p, ldp, n, v + c, ldv, o + c, ldo); break;
        default: break;
    }
    c += (dv - c) / 16 * 16;
    for (int i = 0; i < ROWS; ++i)  // the last dv % 16 columns, plainly
        for (int64_t j = 0; j < n; ++j)
            for (int64_t t = c; t < dv; ++t) o[i * ldo + t] += p[i * ldp + j] * v[j * ldv + t];
}

// o (rows × dv) += p (rows × n) · v (n × dv), rows <= MR.
void pv(const float* p, int64_t ldp, int64_t rows, int64_t n, const float* v, int64_t ldv, float* o,
        int64_t ldo, int64_t dv) {
    for (int64_t r = 0; r < rows; r += MR_PV) {
        int64_t left = rows - r;
        const float* pr = p + r * ldp;
        float* orow = o + r * ldo;
        switch (left >= MR_PV ? MR_PV : left) {
            case 6: pv_rows<6>(pr, ldp, n, v, ldv, orow, ldo, dv); break;
            case 5: pv_rows<5>(pr, ldp, n, v, ldv, orow, ldo, dv); break;
            case 4: pv_rows<4>(pr, ldp, n, v, ldv, orow, ldo, dv); break;
            case 3: pv_rows<3>(pr, ldp, n, v, ldv, orow, ldo, dv); break;
            case 2: pv_rows<2>(pr, ldp, n, v, ldv, orow, ldo, dv); break;
            default: pv_rows<1>(pr, ldp, n, v, ldv, orow, ldo, dv); break;
        }
    }
}

struct Problem {
    const float *q, *k, *v;
    float* out;
    const uint8_t* mask;  // nullptr or bool bytes, True = may attend
    int64_t B, H, Hkv, Sq, Sk, D, Dv;
    int64_t qs[3], ks[3], vs[3], os[3], ms[4];  // strides (b, h, s) in elements; mask (b, h, i, j)
    float scale;  // scale · log2(e)
    bool causal;
    int64_t window;  // 0: none
};

struct Buffers {
    float *qbuf, *kt, *s, *m, *l, *o;
    bool ok() const { return qbuf && kt && s && m && l && o; }
    void release() {
        for (float* p : {qbuf, kt, s, m, l, o}) std::free(p);
    }
};

float* alloc(int64_t n) {
    size_t bytes = (size_t(std::max<int64_t>(n, 16)) * sizeof(float) + 63) / 64 * 64;
    return static_cast<float*>(std::aligned_alloc(64, bytes));
}

// Keys [lo, hi) that query position range [p0, p1) may see (structure only).
inline void key_range(const Problem& P, int64_t p0, int64_t p1, int64_t& lo, int64_t& hi) {
    int64_t off = P.Sk - P.Sq;
    lo = 0;
    hi = P.Sk;
    if (P.causal) hi = std::min(hi, p1 - 1 + off + 1);
    if (P.window > 0) {
        lo = std::max<int64_t>(lo, p0 + off - P.window + 1);
        if (!P.causal) hi = std::min(hi, p1 - 1 + off + P.window);
    }
    lo = std::max<int64_t>(lo, 0);
}

// One query row of a chunk: mask its scores si[0, width) (keys j0 + j; width a
// multiple of 16; columns from `valid` on are not keys), then the online softmax
// (base 2): m' = max(m, max si), o *= 2^(m - m'), l = l·2^(m - m') + Σ 2^(si - m'),
// leaving the probabilities 2^(si - m') in si for p · v.
inline void row_update(const Problem& P, float* __restrict si, int64_t width, int64_t valid, int64_t j0,
                       int64_t pos, const uint8_t* mrow, float& m, float& l, float* __restrict orow) {
    // Structural limits for this query (key position pos), as column indices into si.
    int64_t a = 0, e = valid;
    if (P.causal) e = std::min(e, pos + 1 - j0);
    if (P.window > 0) {
        a = std::max(a, pos - P.window + 1 - j0);
        if (!P.causal) e = std::min(e, pos + P.window - j0);
    }
    a = std::clamp<int64_t>(a, 0, width);
    e = std::clamp<int64_t>(e, a, width);
    for (int64_t j = 0; j < a; ++j) si[j] = NEG_INF;
    for (int64_t j = e; j < width; ++j) si[j] = NEG_INF;
    if (mrow)
        for (int64_t j = a; j < e; ++j)
            if (!mrow[(j0 + j) * P.ms[3]]) si[j] = NEG_INF;
    v16 mx = splat(NEG_INF);
    for (int64_t j = 0; j < width; j += 16) mx = vmax(mx, load(si + j));
    const float m_new = std::max(m, hmax(mx));
    // No allowed key yet: keep probabilities 0 (2^-inf) without NaN.
    const float m_use = m_new == NEG_INF ? 0.f : m_new;
    const float alpha = exp2v(splat(m - m_use))[0];
    v16 sum = (v16){};
    const v16 mv = splat(m_use);
    for (int64_t j = 0; j < width; j += 16) {
        v16 pj = exp2v(load(si + j) - mv);
        store(si + j, pj);
        sum += pj;
    }
    m = m_new;
    l = l * alpha + hsum(sum);
    if (alpha != 1.f)
        for (int64_t t = 0; t < P.Dv; ++t) orow[t] *= alpha;
}

void run_item(const Problem& P, Buffers& buf, int64_t b, int64_t kvh, int64_t p0, int64_t p1, int64_t qt_pad) {
    const int64_t G = P.H / P.Hkv, D = P.D, Dv = P.Dv, rows = p1 - p0;
    const int64_t off = P.Sk - P.Sq;
    // Scaled queries of the G heads: (G, qt_pad, D), padding rows zero.
    for (int64_t g = 0; g < G; ++g) {
        const float* src = P.q + b * P.qs[0] + (kvh * G + g) * P.qs[1];
        float* dst = buf.qbuf + g * qt_pad * D;
        for (int64_t r = 0; r < qt_pad; ++r) {
            if (r < rows) {
                const float* qr = src + (p0 + r) * P.qs[2];
                for (int64_t t = 0; t < D; ++t) dst[r * D + t] = qr[t] * P.scale;
            } else {
                std::memset(dst + r * D, 0, sizeof(float) * D);
            }
        }
    }
    for (int64_t r = 0; r < G * rows; ++r) { buf.m[r] = NEG_INF; buf.l[r] = 0.f; }
    std::memset(buf.o, 0, sizeof(float) * G * rows * Dv);

    int64_t lo, hi;
    key_range(P, p0, p1, lo, hi);
    lo = lo / NR * NR;  // panel aligned
    const float* kb = P.k + b * P.ks[0] + kvh * P.ks[1];
    const float* vb = P.v + b * P.vs[0] + kvh * P.vs[1];
    for (int64_t c0 = lo; c0 < hi; c0 += KC) {
        const int64_t c1 = std::min(c0 + KC, hi);
        const int64_t npan = (c1 - c0 + NR - 1) / NR;
        // Pack K[c0, c1) as panels (D, 32): kt[pan][t][j] = K[c0 + 32·pan + j][t]; zero past Sk.
        for (int64_t pan = 0; pan < npan; ++pan) {
            float* dst = buf.kt + pan * D * NR;
            for (int64_t j = 0; j < NR; ++j) {
                int64_t key = c0 + pan * NR + j;
                if (key < P.Sk) {
                    const float* kr = kb + key * P.ks[2];
                    for (int64_t t = 0; t < D; ++t) dst[t * NR + j] = kr[t];
                } else {
                    for (int64_t t = 0; t < D; ++t) dst[t * NR + j] = 0.f;
                }
            }
        }
        for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kvh * G + g;
            for (int64_t r0 = 0; r0 < rows; r0 += MR) {
                const int64_t nr = std::min<int64_t>(MR, rows - r0);
                int64_t blo, bhi;  // keys these rows may see
                key_range(P, p0 + r0, p0 + r0 + nr, blo, bhi);
                blo = std::max(blo, c0);
                bhi = std::min(bhi, c1);
                if (bhi <= blo) continue;
                const int64_t pa = (blo - c0) / NR, pb = (bhi - c0 + NR - 1) / NR;
                const int64_t j0 = c0 + pa * NR, width = (pb - pa) * NR;  // score columns [j0, j0 + width)
                float* s = buf.s;  // (MR, KC)
                for (int64_t pan = pa; pan < pb; ++pan)
                    qk_tile(buf.qbuf + (g * qt_pad + r0) * D, D, buf.kt + pan * D * NR, s + (pan - pa) * NR, KC);
                const int64_t valid = std::min(j0 + width, P.Sk) - j0;  // columns that are real keys
                for (int64_t i = 0; i < nr; ++i) {
                    const uint8_t* mrow = P.mask ? P.mask + b * P.ms[0] + h * P.ms[1] + (p0 + r0 + i) * P.ms[2] : nullptr;
                    const int64_t row = g * rows + r0 + i;
                    row_update(P, s + i * KC, width, valid, j0, p0 + r0 + i + off, mrow, buf.m[row], buf.l[row],
                               buf.o + row * Dv);
                }
                pv(s, KC, nr, valid, vb + j0 * P.vs[2], P.vs[2], buf.o + (g * rows + r0) * Dv, Dv, Dv);
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        float* ob = P.out + b * P.os[0] + (kvh * G + g) * P.os[1];
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t row = g * rows + r;
            const float inv = buf.l[row] > 0.f ? 1.f / buf.l[row] : 0.f;
            const float* src = buf.o + row * Dv;
            float* dst = ob + (p0 + r) * P.os[2];
            for (int64_t t = 0; t < Dv; ++t) dst[t] = src[t] * inv;
        }
    }
}

// Decoding: few query rows per K/V head (G heads × Sq queries), so K and V are streamed
// once, in place, with no packing: scores are dot products along D. An item is
// (b, K/V head, key split); with fewer heads than threads the keys are split and the
// partial (m, l, o) merged at the end (flash-decoding).
void decode_item(const Problem& P, Buffers& buf, int64_t b, int64_t kvh, int64_t k0, int64_t k1, float* part) {
    const int64_t G = P.H / P.Hkv, D = P.D, Dv = P.Dv, Sq = P.Sq, rows = G * Sq;
    const int64_t off = P.Sk - P.Sq;
    for (int64_t g = 0; g < G; ++g) {  // row g·Sq + i: head kvh·G + g, query i
        const float* src = P.q + b * P.qs[0] + (kvh * G + g) * P.qs[1];
        for (int64_t i = 0; i < Sq; ++i)
            for (int64_t t = 0; t < D; ++t) buf.qbuf[(g * Sq + i) * D + t] = src[i * P.qs[2] + t] * P.scale;
    }
    for (int64_t r = 0; r < rows; ++r) { buf.m[r] = NEG_INF; buf.l[r] = 0.f; }
    std::memset(buf.o, 0, sizeof(float) * rows * Dv);
    int64_t lo, hi;
    key_range(P, 0, Sq, lo, hi);
    lo = std::max(lo, k0);
    hi = std::min(hi, k1);
    const float* kb = P.k + b * P.ks[0] + kvh * P.ks[1];
    const float* vb = P.v + b * P.vs[0] + kvh * P.vs[1];
    for (int64_t c0 = lo; c0 < hi; c0 += KD) {
        const int64_t n = std::min(KD, hi - c0), width = (n + 15) / 16 * 16;
        int64_t j = 0;
        if (D % 16 == 0)  // 16 keys at a time, their 16 sums reduced together
            for (; j + 16 <= n; j += 16)
                for (int64_t r = 0; r < rows; ++r)
                    store(buf.s + r * KD + j, dot16(buf.qbuf + r * D, kb + (c0 + j) * P.ks[2], P.ks[2], D));
        for (; j < n; ++j) {
            const float* kr = kb + (c0 + j) * P.ks[2];
            for (int64_t r = 0; r < rows; ++r) buf.s[r * KD + j] = dot(buf.qbuf + r * D, kr, D);
        }
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t g = r / Sq, i = r % Sq;
            const uint8_t* mrow = P.mask ? P.mask + b * P.ms[0] + (kvh * G + g) * P.ms[1] + i * P.ms[2] : nullptr;
            row_update(P, buf.s + r * KD, width, n, c0, i + off, mrow, buf.m[r], buf.l[r], buf.o + r * Dv);
        }
        for (int64_t r0 = 0; r0 < rows; r0 += MR)
            pv(buf.s + r0 * KD, KD, std::min<int64_t>(MR, rows - r0), n, vb + c0 * P.vs[2], P.vs[2],
               buf.o + r0 * Dv, Dv, Dv);
    }
    if (part) {  // (rows, Dv + 2): o unnormalised, then m and l, merged by the caller
        for (int64_t r = 0; r < rows; ++r) {
            std::memcpy(part + r * (Dv + 2), buf.o + r * Dv, sizeof(float) * Dv);
            part[r * (Dv + 2) + Dv] = buf.m[r];
            part[r * (Dv + 2) + Dv + 1] = buf.l[r];
        }
        return;
    }
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t g = r / Sq, i = r % Sq;
        const float inv = buf.l[r] > 0.f ? 1.f / buf.l[r] : 0.f;
        float* dst = P.out + b * P.os[0] + (kvh * G + g) * P.os[1] + i * P.os[2];
        for (int64_t t = 0; t < Dv; ++t) dst[t] = buf.o[r * Dv + t] * inv;
    }
}

// Merge the key splits of (b, kvh): weights 2^(m_s - max m) as in the online softmax.
void merge_splits(const Problem& P, const float* part, int64_t splits, int64_t b, int64_t kvh) {
    const int64_t G = P.H / P.Hkv, Dv = P.Dv, Sq = P.Sq, rows = G * Sq, stride = rows * (Dv + 2);
    for (int64_t r = 0; r < rows; ++r) {
        float top = NEG_INF;
        for (int64_t sp = 0; sp < splits; ++sp) top = std::max(top, part[sp * stride + r * (Dv + 2) + Dv]);
        const float use = top == NEG_INF ? 0.f : top;
        float total = 0.f;
        const int64_t g = r / Sq, i = r % Sq;
        float* dst = P.out + b * P.os[0] + (kvh * G + g) * P.os[1] + i * P.os[2];
        for (int64_t t = 0; t < Dv; ++t) dst[t] = 0.f;
        for (int64_t sp = 0; sp < splits; ++sp) {
            const float* src = part + sp * stride + r * (Dv + 2);
            const float w = exp2v(splat(src[Dv] - use))[0];
            total += src[Dv + 1] * w;
            for (int64_t t = 0; t < Dv; ++t) dst[t] += src[t] * w;
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t t = 0; t < Dv; ++t) dst[t] *= inv;
    }
}

}  // namespace

namespace {

Problem make_problem(const float* q, const float* k, const float* v, float* out, const uint8_t* mask,
                     const int64_t* dims, const int64_t* strides, float scale, int causal, int64_t window) {
    Problem P{};
    P.q = q; P.k = k; P.v = v; P.out = out; P.mask = mask;
    P.B = dims[0]; P.H = dims[1]; P.Hkv = dims[2]; P.Sq = dims[3]; P.Sk = dims[4]; P.D = dims[5]; P.Dv = dims[6];
    for (int i = 0; i < 3; ++i) {
        P.qs[i] = strides[i]; P.ks[i] = strides[3 + i]; P.vs[i] = strides[6 + i]; P.os[i] = strides[9 + i];
    }
    for (int i = 0; i < 4; ++i) P.ms[i] = strides[12 + i];
    P.scale = scale * 1.4426950408889634f;  // scores in base 2: 2^(s·log2 e) = e^s
    P.causal = causal != 0;
    P.window = window;
    return P;
}

bool valid(const Problem& P) {
    return P.B >= 0 && P.Sq >= 0 && P.Sk >= 0 && P.Hkv > 0 && P.H > 0 && P.H % P.Hkv == 0 && P.D > 0 && P.Dv > 0;
}

}  // namespace

// q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv) -> out (B, H, Sq, Dv); strides:
// q, k, v, out (b, h, s) then mask (b, h, i, j), in elements; last dims contiguous.
extern "C" int mh_attention_f32(const float* q, const float* k, const float* v, float* out, const uint8_t* mask,
                                const int64_t* dims, const int64_t* strides, float scale, int causal,
                                int64_t window, int64_t query_tile, int threads) {
    const Problem P = make_problem(q, k, v, out, mask, dims, strides, scale, causal, window);
    if (!valid(P) || query_tile <= 0) return -2;
    const int64_t G = P.H / P.Hkv;
    const int64_t qt = std::min(query_tile, std::max<int64_t>(P.Sq, 1));
    const int64_t tiles = (P.Sq + qt - 1) / qt;
    const int64_t items = P.B * P.Hkv * tiles;
    const int64_t qt_pad = (qt + MR - 1) / MR * MR;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        Buffers buf{alloc(G * qt_pad * P.D), alloc(KC * P.D), alloc(MR * KC), alloc(G * qt), alloc(G * qt),
                    alloc(G * qt * P.Dv)};
        if (!buf.ok()) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            // Later query tiles see more keys under a causal mask: hand them out first.
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; ++it) {
                const int64_t tile = tiles - 1 - it % tiles, rest = it / tiles;
                const int64_t kvh = rest % P.Hkv, b = rest / P.Hkv;
                const int64_t p0 = tile * qt, p1 = std::min(p0 + qt, P.Sq);
                run_item(P, buf, b, kvh, p0, p1, qt_pad);
            }
        }
        buf.release();
    }
    return failed ? -1 : 0;
}

// As mh_attention_f32, for few query rows per K/V head (G·Sq): see decode_item.
extern "C" int mh_decode_f32(const float* q, const float* k, const float* v, float* out, const uint8_t* mask,
                             const int64_t* dims, const int64_t* strides, float scale, int causal, int64_t window,
                             int threads) {
    const Problem P = make_problem(q, k, v, out, mask, dims, strides, scale, causal, window);
    if (!valid(P)) return -2;
    const int64_t G = P.H / P.Hkv, rows = G * P.Sq, heads = P.B * P.Hkv;
    // Enough items for every thread, each split keeping at least 512 keys.
    const int64_t splits = std::clamp<int64_t>(std::min<int64_t>((2 * threads + heads - 1) / std::max<int64_t>(heads, 1),
                                                                 P.Sk / 512), 1, 64);
    const int64_t per = (P.Sk + splits - 1) / splits, items = heads * splits;
    float* part = nullptr;
    if (splits > 1 && !(part = alloc(items * rows * (P.Dv + 2)))) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        Buffers buf{alloc(rows * P.D), alloc(1), alloc(rows * KD), alloc(rows), alloc(rows), alloc(rows * P.Dv)};
        if (!buf.ok()) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items; ++it) {
                const int64_t sp = it % splits, head = it / splits;
                decode_item(P, buf, head / P.Hkv, head % P.Hkv, sp * per, std::min(P.Sk, (sp + 1) * per),
                            part ? part + it * rows * (P.Dv + 2) : nullptr);
            }
            if (part) {
#pragma omp for schedule(static)
                for (int64_t head = 0; head < heads; ++head)
                    merge_splits(P, part + head * splits * rows * (P.Dv + 2), splits, head / P.Hkv, head % P.Hkv);
            }
        }
        buf.release();
    }
    std::free(part);
    return failed ? -1 : 0;
}

// ---------------------------------------------------------------------------------------
// Few-row linear layers (decoding): out_i (M, N_i) = x (M, K) · W_iᵀ (+ b_i) for `count`
// weights at once (q, k and v projections share x), M <= 4. The weights' rows, all
// weights together, are split evenly across threads; each weight row is read once and
// multiplied with the M rows of x held in L1. Bandwidth-bound: this streams the weights.

namespace {

template <int M>
void gemv_rows(const float* __restrict x, int64_t K, const float* __restrict w, int64_t rows, const float* bias,
               float* __restrict out, int64_t ldo) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        const float* w0 = w + r * K;
        v16 acc[4][M];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
            for (int m = 0; m < M; ++m) acc[i][m] = (v16){};
        int64_t t = 0;
        for (; t + 16 <= K; t += 16) {
            v16 wv[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) wv[i] = load(w0 + i * K + t);
#pragma GCC unroll 4
            for (int m = 0; m < M; ++m) {
                v16 xm = load(x + m * K + t);
#pragma GCC unroll 4
                for (int i = 0; i < 4; ++i) acc[i][m] += wv[i] * xm;
            }
        }
        for (int i = 0; i < 4; ++i)
            for (int m = 0; m < M; ++m) {
                float s = hsum(acc[i][m]);
                for (int64_t u = t; u < K; ++u) s += w0[i * K + u] * x[m * K + u];
                out[m * ldo + r + i] = s + (bias ? bias[r + i] : 0.f);
            }
    }
    for (; r < rows; ++r)
        for (int m = 0; m < M; ++m) out[m * ldo + r] = dot(w + r * K, x + m * K, K) + (bias ? bias[r] : 0.f);
}

void gemv_any(int64_t M, const float* x, int64_t K, const float* w, int64_t rows, const float* bias, float* out,
              int64_t ldo) {
    switch (M) {
        case 1: gemv_rows<1>(x, K, w, rows, bias, out, ldo); break;
        case 2: gemv_rows<2>(x, K, w, rows, bias, out, ldo); break;
        case 3: gemv_rows<3>(x, K, w, rows, bias, out, ldo); break;
        default: gemv_rows<4>(x, K, w, rows, bias, out, ldo); break;
    }
}

// This thread's share (thread id of nt) of out_i (M, N_i; row stride ldo_i) = x · W_iᵀ + b_i:
// the rows of all weights together, split evenly in multiples of 4.
void gemv_share(int64_t id, int64_t nt, int64_t M, const float* x, int64_t K, int64_t count,
                const float* const* W, const int64_t* N, const float* const* bias, float* const* out,
                const int64_t* ldo) {
    int64_t total = 0;
    for (int64_t i = 0; i < count; ++i) total += N[i];
    const int64_t begin = (total * id / nt) / 4 * 4, end = id + 1 == nt ? total : (total * (id + 1) / nt) / 4 * 4;
    int64_t base = 0;
    for (int64_t i = 0; i < count; ++i) {
        const int64_t lo = std::max(begin, base) - base, hi = std::min(end, base + N[i]) - base;
        if (hi > lo) gemv_any(M, x, K, W[i] + lo * K, hi - lo, bias[i] ? bias[i] + lo : nullptr, out[i] + lo, ldo[i]);
        base += N[i];
    }
}

}  // namespace

extern "C" int mh_linear_few_rows_f32(const float* x, int64_t M, int64_t K, int64_t count, const float* const* W,
                                      const int64_t* N, const float* const* bias, float* const* out, int threads) {
    if (M < 1 || M > 4 || K < 1 || count < 1) return -2;
#pragma omp parallel num_threads(threads)
    gemv_share(omp_get_thread_num(), omp_get_num_threads(), M, x, K, count, W, N, bias, out, N);
    return 0;
}

// ---------------------------------------------------------------------------------------
// One whole decoding step of a layer, one token per row (B <= 4), in one parallel region:
//
//   qkv = x · [W_q; W_k; W_v]ᵀ + b          (B, (H + 2·Hkv)·D)   weights split over threads
//   RoPE on q and k at each row's position; k, v written to cache slot lengths[b]
//   heads = attention(q, cache[:lengths[b] + 1])   (decode_item, keys split if few heads)
//   y = heads · W_oᵀ + b_o                    (B, E)
//   lengths[b] += 1; slot_pos[b, old length] = old length
//
// The caller has checked every shape and that each row has room (lengths[b] < capacity).

extern "C" int mh_decode_step_f32(
    const float* x, int64_t B, int64_t E, const float* const* W, const float* const* bias, int64_t H,
    int64_t Hkv, int64_t D, const float* rope_cos, const float* rope_sin, int64_t rotary_dim, int interleaved,
    float* cache_k, float* cache_v, const int64_t* cache_strides, int64_t* lengths, int64_t* slot_pos,
    int64_t capacity, float scale, float* y, int threads) {
    if (B < 1 || B > 4 || Hkv < 1 || H % Hkv != 0 || D < 1 || rotary_dim % 2 != 0 || rotary_dim > D) return -2;
    const int64_t G = H / Hkv, width = (H + 2 * Hkv) * D, half = rotary_dim / 2;
    float* qkv = alloc(B * width);
    float* heads = alloc(B * H * D);
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) longest = std::max(longest, lengths[b] + 1);
    const int64_t heads_b = B * Hkv;
    const int64_t splits = std::clamp<int64_t>(
        std::min<int64_t>((2 * threads + heads_b - 1) / heads_b, longest / 512), 1, 64);
    const int64_t per = (longest + splits - 1) / splits, items = heads_b * splits, rows = G;
    float* part = splits > 1 ? alloc(items * rows * (D + 2)) : nullptr;
    if (!qkv || !heads || (splits > 1 && !part)) {
        std::free(qkv); std::free(heads); std::free(part);
        return -1;
    }
    // One attention problem per row: its own key count.
    Problem Ps[4];
    for (int64_t b = 0; b < B; ++b) {
        Problem& P = Ps[b];
        P = Problem{};
        P.q = qkv; P.k = cache_k; P.v = cache_v; P.out = heads; P.mask = nullptr;
        P.B = B; P.H = H; P.Hkv = Hkv; P.Sq = 1; P.Sk = lengths[b] + 1; P.D = D; P.Dv = D;
        P.qs[0] = width; P.qs[1] = D; P.qs[2] = width;
        for (int i = 0; i < 3; ++i) P.ks[i] = P.vs[i] = cache_strides[i];
        P.os[0] = H * D; P.os[1] = D; P.os[2] = H * D;
        P.scale = scale * 1.4426950408889634f;
        P.causal = true;
        P.window = 0;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
        // Every buffer first: nothing is written to the cache unless the whole step can run.
        Buffers buf{alloc(rows * D), alloc(1), alloc(rows * KD), alloc(rows), alloc(rows), alloc(rows * D)};
        if (!buf.ok()) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            {
                const float* Wqkv[3] = {W[0], W[1], W[2]};
                const float* bqkv[3] = {bias[0], bias[1], bias[2]};
                const int64_t N[3] = {H * D, Hkv * D, Hkv * D}, ld[3] = {width, width, width};
                float* out[3] = {qkv, qkv + H * D, qkv + (H + Hkv) * D};
                gemv_share(id, nt, B, x, E, 3, Wqkv, N, bqkv, out, ld);
            }
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t t = 0; t < B * (H + Hkv); ++t) {  // rotate q and k heads, store k and v
                const int64_t b = t / (H + Hkv), head = t % (H + Hkv), pos = lengths[b];
                float* vec = qkv + b * width + head * D;
                if (rope_cos) {
                    const float* c = rope_cos + pos * half;
                    const float* s = rope_sin + pos * half;
                    for (int64_t i = 0; i < half; ++i) {
                        const int64_t i1 = interleaved ? 2 * i : i, i2 = interleaved ? 2 * i + 1 : i + half;
                        const float x1 = vec[i1], x2 = vec[i2];
                        vec[i1] = x1 * c[i] - x2 * s[i];
                        vec[i2] = x2 * c[i] + x1 * s[i];
                    }
                }
                if (head >= H) {
                    const int64_t kvh = head - H;
                    const int64_t at = b * cache_strides[0] + kvh * cache_strides[1] + pos * cache_strides[2];
                    std::memcpy(cache_k + at, vec, sizeof(float) * D);
                    std::memcpy(cache_v + at, qkv + b * width + (H + Hkv + kvh) * D, sizeof(float) * D);
                }
            }
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items; ++it) {
                const int64_t sp = it % splits, head = it / splits, b = head / Hkv;
                decode_item(Ps[b], buf, b, head % Hkv, sp * per, std::min(Ps[b].Sk, (sp + 1) * per),
                            part ? part + it * rows * (D + 2) : nullptr);
            }
            if (part) {
#pragma omp for schedule(static)
                for (int64_t head = 0; head < heads_b; ++head)
                    merge_splits(Ps[head / Hkv], part + head * splits * rows * (D + 2), splits, head / Hkv,
                                 head % Hkv);
            }
            const float* Wo[1] = {W[3]};
            const float* bo[1] = {bias[3]};
            const int64_t N[1] = {E}, ld[1] = {E};
            float* out[1] = {y};
            gemv_share(id, nt, B, heads, H * D, 1, Wo, N, bo, out, ld);
        }
        buf.release();
    }
    std::free(qkv); std::free(heads); std::free(part);
    if (failed) return -1;
    for (int64_t b = 0; b < B; ++b) {
        slot_pos[b * capacity + lengths[b]] = lengths[b];
        lengths[b] += 1;
    }
    return 0;
}
