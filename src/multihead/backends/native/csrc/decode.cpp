// multihead's native CPU kernels for decoding: forward only.
//
// * mh_decode_f32 (_bf16, _f16): attention for few query rows per K/V head (decode_item).
// * mh_linear_few_rows_f32: x · Wᵀ + b for a few rows of x and several weights at once.
// * mh_decode_step_f32 (_bf16, _f16): a whole decoding step of a layer in one parallel region.
//
// All are bandwidth-bound: they stream K/V and the weights once, in place. In bfloat16 and
// float16 (x, weights, cache, out of that type) they stream half the bytes: values are
// widened to float32 in registers as loaded, all arithmetic is float32, and what is stored
// (out, the new K/V cache rows) is rounded to nearest even (common.h).
// Returns 0, or a negative code: -1 out of memory, -2 unsupported shape.

#include "common.h"
#include "kernels.h"

#include <atomic>
#include <chrono>
#include <type_traits>

namespace {

using namespace mh;

#if MH_VECTOR_FLOATS == 8
// o (rows × dv) += p (rows × n) · v (n × dv) for decoding (AVX2), V streamed from memory:
// one row of o at a time, whole rows of V (up to 8 vectors) per key, so V is read front to
// back (the hardware prefetcher's order) by the first row and from L1 by the others, in
// blocks of PV_KEYS keys. (The prefill's 6 × 16 tiles would read every V row in four
// strided passes.) Half precision V with several rows: each block is widened once into
// `wide` (PV_KEYS × dv floats, L1) and read from there by every row, instead of being
// widened once per row.
template <class TV>
inline void pv_stream(const float* p, int64_t ldp, int64_t rows, int64_t n, const TV* v, int64_t ldv, float* o,
                      int64_t ldo, int64_t dv, float* wide) {
    for (int64_t j = 0; j < n; j += PV_KEYS) {
        const int64_t nj = std::min(PV_KEYS, n - j);
        if constexpr (!std::is_same_v<TV, float>) {
            if (rows > 1) {
                for (int64_t jj = 0; jj < nj; ++jj) {
                    const TV* src = v + (j + jj) * ldv;
                    int64_t t = 0;
                    for (; t + W <= dv; t += W) store(wide + jj * dv + t, load_f(src + t));
                    for (; t < dv; ++t) wide[jj * dv + t] = to_f32(src[t]);
                }
                pv_stream<float>(p + j, ldp, rows, nj, wide, dv, o, ldo, dv, nullptr);
                continue;
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            const float* pr = p + r * ldp + j;
            const TV* vj = v + j * ldv;
            float* orow = o + r * ldo;
            int64_t c = 0;
            for (; c + 8 * W <= dv; c += 8 * W) pv_tile<1, 8>(pr, ldp, nj, vj + c, ldv, orow + c, ldo);
            switch ((dv - c) / W) {
                case 7: pv_tile<1, 7>(pr, ldp, nj, vj + c, ldv, orow + c, ldo); break;
                case 6: pv_tile<1, 6>(pr, ldp, nj, vj + c, ldv, orow + c, ldo); break;
                case 5: pv_tile<1, 5>(pr, ldp, nj, vj + c, ldv, orow + c, ldo); break;
                case 4: pv_tile<1, 4>(pr, ldp, nj, vj + c, ldv, orow + c, ldo); break;
                case 3: pv_tile<1, 3>(pr, ldp, nj, vj + c, ldv, orow + c, ldo); break;
                case 2: pv_tile<1, 2>(pr, ldp, nj, vj + c, ldv, orow + c, ldo); break;
                case 1: pv_tile<1, 1>(pr, ldp, nj, vj + c, ldv, orow + c, ldo); break;
                default: break;
            }
            c += (dv - c) / W * W;
            for (int64_t jj = 0; jj < nj; ++jj)  // the last dv % W columns, plainly
                for (int64_t t = c; t < dv; ++t) orow[t] += pr[jj] * to_f32(vj[jj * ldv + t]);
        }
    }
}
#endif

#if (MH_VECTOR_FLOATS == 8 && defined(__AVX2__)) || MH_VECTOR_FLOATS == 16  // AVX2 or AVX-512
// Decoding's register-blocked products (AVX2; q·kᵀ also AVX-512), for D and Dv multiples of 2·W
// (float32 q·kᵀ: of W): up to 4 query rows
// (the G heads sharing a K/V head) at once, so each K and V value is loaded and widened once
// per block of rows, not once per row. bf16 K/V are widened 16 at a time as their
// even- and odd-indexed halves (a shift and an and: bf16 is the high half of a float32), so
// q (and the output's columns) are kept in that order: each block of 2·W values as its W
// even-indexed, then its W odd-indexed ones (split_even_odd). float32 and float16 in plain order.
template <class T>
constexpr int PARTS = std::is_same_v<T, bf16> ? 2 : 1;  // vectors per widened load

// PARTS<T> vectors from PARTS<T>·W consecutive values at p: bf16 [even, odd]; others one vector.
template <class T>
inline void widen(const T* p, vf* out) {
#if MH_VECTOR_FLOATS == 16
    if constexpr (PARTS<T> == 2) {
        const __m512i bits = _mm512_loadu_si512(p);
        out[0] = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
        out[1] = (vf)_mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
    } else {
        out[0] = load_f(p);
    }
#else
    if constexpr (PARTS<T> == 2) {
        const __m256i bits = _mm256_loadu_si256((const __m256i*)p);
        out[0] = (vf)_mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
        out[1] = (vf)_mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
    } else {
        out[0] = load_f(p);
    }
#endif
}

// xs (M × K) = x (M × K) with each block of 2·W values reordered: the W even-indexed, then the
// W odd-indexed (the order bf16 values are widened in: gemv_rows_bf16, widen).
inline void split_even_odd(const float* x, int64_t M, int64_t K, float* xs) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t t = 0; t < K; t += 2 * W)
            for (int i = 0; i < W; ++i) {
                xs[m * K + t + i] = x[m * K + t + 2 * i];
                xs[m * K + t + W + i] = x[m * K + t + 2 * i + 1];
            }
}

// The inverse of split_even_odd for one row of n values.
inline void join_even_odd(const float* xs, int64_t n, float* x) {
    for (int64_t t = 0; t < n; t += 2 * W)
        for (int i = 0; i < W; ++i) { x[t + 2 * i] = xs[t + i]; x[t + 2 * i + 1] = xs[t + W + i]; }
}

// Rows [first, last) of x (row stride ld, `bytes` bytes each) prefetched (into L2 by default);
// past the end of x they are harmless (prefetches never fault).
template <int HINT = _MM_HINT_T1, class T>
inline void prefetch_rows(const T* x, int64_t first, int64_t last, int64_t ld, int64_t bytes) {
    for (int64_t j = first; j < last; ++j) {
        const char* row = reinterpret_cast<const char*>(x + j * ld);
        for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(row + c, static_cast<_mm_hint>(HINT));
        _mm_prefetch(row + bytes - 1, static_cast<_mm_hint>(HINT));
    }
}

// acc[r][s] = lane-wise partial sums of q row r (R rows of D, row stride D) · key s (NK keys
// at k, row stride ldk).
template <int R, int NK, class T>
inline void qk_partial(const float* __restrict q, int64_t D, const T* __restrict k, int64_t ldk,
                       vf (&acc)[R][NK]) {
    constexpr int P = PARTS<T>;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int s = 0; s < NK; ++s) acc[r][s] = (vf){};
    for (int64_t t = 0; t < D; t += P * W) {
        vf kv[NK][P];
#pragma GCC unroll 4
        for (int s = 0; s < NK; ++s) widen(k + s * ldk + t, kv[s]);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
            for (int p = 0; p < P; ++p) {
                vf qv = load(q + r * D + t + p * W);
                __asm__("" : "+x"(qv));  // in a register: loaded once for the NK keys, not once per FMA
#pragma GCC unroll 4
                for (int s = 0; s < NK; ++s) acc[r][s] += qv * kv[s][p];
            }
    }
}

#if MH_VECTOR_FLOATS == 16
// Keys ahead that the AVX-512 q·kᵀ prefetches K into L1; V is prefetched into L2 at the keys it
// is on, so that K and V stream together and p·v finds V in L2. Measured (the bf16 decoding
// step at the layer, cold, 200 interleaved paired rounds, Intel Xeon): K 32 keys ahead
// took the attention to 0.78× (16, 64 and 128 keys and into L2 the same), V with it to 0.74×
// of that again (64 or 128 keys ahead the same, into L1 the same); float32's attention 0.68×.
constexpr int64_t K_AHEAD16 = 32;

// s[r][j + u] (row stride lds) = q row r · key j + u for R ≤ 4 rows and the n keys at k (AVX-512):
// 4 keys at a time, their R × 4 partial sums (16 accumulators of the 32 registers) reduced
// together by one reduce_w; each K value is loaded and widened once for the R rows. (The plain
// loop, dot_w over keys widened into a buffer, took 68% of the bf16 decoding item's time, ~30
// cycles a key for 4 rows; this one 0.62× the item's time from L2; Intel Xeon, perf.) Given v
// (row stride ldv), V's rows of the same keys are prefetched into L2 (K_AHEAD16).
template <int R, class T>
inline void qk_rows(const float* q, int64_t D, const T* k, int64_t ldk, int64_t n, float* s, int64_t lds,
                    const T* v = nullptr, int64_t ldv = 0) {
    const int64_t bytes = D * int64_t(sizeof(T));
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        prefetch_rows<_MM_HINT_T0>(k, j + K_AHEAD16, j + K_AHEAD16 + 4, ldk, bytes);
        if (v) prefetch_rows(v, j, j + 4, ldv, bytes);
        vf acc[R][4];
        qk_partial<R, 4>(q, D, k + j * ldk, ldk, acc);
        vf x[16];  // x[4·r + u]: row r, key j + u (zero past R rows): lane 4·r + u of the sums
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
            for (int u = 0; u < 4; ++u) x[4 * r + u] = r < R ? acc[r < R ? r : 0][u] : (vf){};
        const __m512 sums = (__m512)reduce_w(x);  // 128-bit lane r: row r's 4 scores
        _mm_storeu_ps(s + j, _mm512_castps512_ps128(sums));
        if (R > 1) _mm_storeu_ps(s + lds + j, _mm512_extractf32x4_ps(sums, 1));
        if (R > 2) _mm_storeu_ps(s + 2 * lds + j, _mm512_extractf32x4_ps(sums, 2));
        if (R > 3) _mm_storeu_ps(s + 3 * lds + j, _mm512_extractf32x4_ps(sums, 3));
    }
    for (; j < n; ++j) {
        vf acc[R][1];
        qk_partial<R, 1>(q, D, k + j * ldk, ldk, acc);
        for (int r = 0; r < R; ++r) s[r * lds + j] = hsum(acc[r][0]);
    }
}
#endif

#if MH_VECTOR_FLOATS == 8
// Keys ahead that the 4-row q·kᵀ prefetches K into L1 (the float32 step 0.94-0.95× the time
// of the blocked loop's without any, where that was 0.96×; bf16 0.99-1.00×, noise; 8 and 32
// keys no better; into L2 instead: 0.96×).
constexpr int64_t K_AHEAD = 16;

// Rows j and j + 1 of x (row stride ld, `bytes` bytes each) prefetched into L1; past the end of
// x (prefetches never fault) they are harmless, so the caller does not check. (prefetch_rows'
// bounded per-row loop in this place measured the float32 attention 0.91× against 0.87×.)
template <class T>
inline void prefetch_ahead(const T* x, int64_t j, int64_t ld, int64_t bytes) {
    const uintptr_t row = reinterpret_cast<uintptr_t>(x) + uintptr_t(j * ld) * sizeof(T);
    for (int64_t c = 0; c < bytes; c += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(row + c), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(row + ld * sizeof(T) + c), _MM_HINT_T0);
    }
}

// s[r][j0 + j] (row stride lds) = q row r · key j for R rows and the n keys at k.
template <int R, class T>
inline void qk_rows(const float* q, int64_t D, const T* k, int64_t ldk, int64_t n, float* s, int64_t lds) {
    int64_t j = 0;
    if constexpr (R == 4) {
        for (; j + 2 <= n; j += 2) {  // 2 keys: their 8 sums reduced together in registers
            prefetch_ahead(k, j + K_AHEAD, ldk, D * sizeof(T));
            vf acc[4][2];
            qk_partial<4, 2>(q, D, k + j * ldk, ldk, acc);
            __m256 h[4];
            for (int r = 0; r < 4; ++r) h[r] = _mm256_hadd_ps((__m256)acc[r][0], (__m256)acc[r][1]);
            const __m256 g01 = _mm256_hadd_ps(h[0], h[1]), g23 = _mm256_hadd_ps(h[2], h[3]);
            // lanes: rows 0, 0, 1, 1, 2, 2, 3, 3 of keys j, j + 1, ...
            const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(g01, g23, 0x20),
                                             _mm256_permute2f128_ps(g01, g23, 0x31));
            const __m128 lo = _mm256_castps256_ps128(sum), hi = _mm256_extractf128_ps(sum, 1);
            _mm_storel_pi(reinterpret_cast<__m64*>(s + j), lo);
            _mm_storeh_pi(reinterpret_cast<__m64*>(s + lds + j), lo);
            _mm_storel_pi(reinterpret_cast<__m64*>(s + 2 * lds + j), hi);
            _mm_storeh_pi(reinterpret_cast<__m64*>(s + 3 * lds + j), hi);
        }
    }
    for (; j + W <= n; j += W) {  // W keys: their R·W sums reduced together
        vf part[R][W];
#pragma GCC unroll 4
        for (int u = 0; u < W; u += 2) {
            vf acc[R][2];
            qk_partial<R, 2>(q, D, k + (j + u) * ldk, ldk, acc);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) { part[r][u] = acc[r][0]; part[r][u + 1] = acc[r][1]; }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) store(s + r * lds + j, reduce_w(part[r]));
    }
    for (; j < n; ++j) {
        vf acc[R][1];
        qk_partial<R, 1>(q, D, k + j * ldk, ldk, acc);
        for (int r = 0; r < R; ++r) s[r * lds + j] = hsum(acc[r][0]);
    }
}

// o rows (R, row stride ldo) += p (R × n, row stride ldp) · v (n keys, row stride ldv), for the
// 2·W columns at v and o (bf16: one widened load, o's columns in split_even_odd's order).
template <int R, class T>
inline void pv_rows16(const float* __restrict p, int64_t ldp, int64_t n, const T* __restrict v, int64_t ldv,
                      float* __restrict o, int64_t ldo) {
    constexpr int P = PARTS<T>;
    vf acc[R][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) { acc[r][0] = load(o + r * ldo); acc[r][1] = load(o + r * ldo + W); }
    for (int64_t j = 0; j < n; ++j) {
        vf vv[2];
#pragma GCC unroll 2
        for (int u = 0; u < 2; u += P) widen(v + j * ldv + u * W, vv + u);
        __asm__("" : "+x"(vv[0]), "+x"(vv[1]));  // in registers: loaded once, not once per FMA
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            const vf pr = splat(p[r * ldp + j]);
            acc[r][0] += pr * vv[0];
            acc[r][1] += pr * vv[1];
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) { store(o + r * ldo, acc[r][0]); store(o + r * ldo + W, acc[r][1]); }
}
#endif  // MH_VECTOR_FLOATS == 8

// Rows [0, rows) in blocks of 4: f(block's first row, the block's rows as a constant).
template <class F>
inline void by_row_blocks(int64_t rows, F&& f) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) f(r, std::integral_constant<int, 4>{});
    switch (rows - r) {
        case 3: f(r, std::integral_constant<int, 3>{}); break;
        case 2: f(r, std::integral_constant<int, 2>{}); break;
        case 1: f(r, std::integral_constant<int, 1>{}); break;
        default: break;
    }
}

// s (rows × n, row stride lds) = q (rows × D) · kᵀ: key blocks of W outermost, so each block
// of K is read from memory once and from L1 by the other row blocks.
template <class T>
inline void qk_blocked(const float* q, int64_t rows, int64_t D, const T* k, int64_t ldk, int64_t n, float* s,
                       int64_t lds, [[maybe_unused]] const T* v = nullptr, [[maybe_unused]] int64_t ldv = 0) {
    for (int64_t j = 0; j < n; j += 8 * W) {
        const int64_t nj = std::min<int64_t>(8 * W, n - j);
        by_row_blocks(rows, [&](int64_t r, auto R) {
#if MH_VECTOR_FLOATS == 16  // the first row block prefetches V (qk_rows)
            qk_rows<decltype(R)::value>(q + r * D, D, k + j * ldk, ldk, nj, s + r * lds + j, lds,
                                        r == 0 && v ? v + j * ldv : nullptr, ldv);
#else
            qk_rows<decltype(R)::value>(q + r * D, D, k + j * ldk, ldk, nj, s + r * lds + j, lds);
#endif
        });
    }
}

#if MH_VECTOR_FLOATS == 8
// o (rows × dv) += p (rows × n) · v (n × dv): blocks of PV_KEYS keys (in L1), then 16 columns,
// then the row blocks, each block's pass prefetching its share of the next block into L2
// (without it the bf16 step's attention takes 1.14×, cold, 300 interleaved paired rounds;
// the whole next block in the first pass 1.09×, two blocks ahead 1.05×, into L1 the same).
// K is prefetched by the 4-row q·kᵀ (K_AHEAD). An earlier prefetch of K 128 keys ahead (64
// and 256 tried), with V's first block prefetched as a chunk starts and chunks of 256 keys
// instead of whole splits, measured no faster (1,000 interleaved paired rounds: 0.98× and
// 1.00×, with an untouched control at 0.98× in the same loops). The time stays above both
// the read's and the arithmetic's (54 cycles a key and K/V head from L2, one core), the
// prefetchers hiding only part of one under the other.
template <class T>
inline void pv_blocked(const float* p, int64_t ldp, int64_t rows, int64_t n, const T* v, int64_t ldv, float* o,
                       int64_t ldo, int64_t dv) {
    for (int64_t j = 0; j < n; j += PV_KEYS) {
        const int64_t nj = std::min(PV_KEYS, n - j), ahead = std::min(PV_KEYS, n - j - nj), passes = dv / (2 * W);
        for (int64_t c = 0; c < dv; c += 2 * W) {
            const int64_t pass = c / (2 * W);  // each pass prefetches its share of the next block
            prefetch_rows(v + (j + nj) * ldv, ahead * pass / passes, ahead * (pass + 1) / passes, ldv, dv * sizeof(T));
            by_row_blocks(rows, [&](int64_t r, auto R) {
                pv_rows16<decltype(R)::value>(p + r * ldp + j, ldp, nj, v + j * ldv + c, ldv, o + r * ldo + c, ldo);
            });
        }
    }
}
#endif  // MH_VECTOR_FLOATS == 8
#endif  // AVX2 or AVX-512

// Row stride (floats) of decode_item's scores for a key range of `keys`: its chunk rounded up to
// W, plus W. A stride of KD floats (8 KiB) put every row's start in one L1 set, so 16 rows (a
// short prefill) thrashed its 12 ways.
inline int64_t score_stride(int64_t keys) { return (std::clamp<int64_t>(keys, 1, KD) + W - 1) / W * W + W; }

// Keys at most (after the rows' key range) for small_item; its scores (SMALL_KEYS · W floats)
// and two W × W tiles fit decode_item's score buffer for any row count it takes.
constexpr int64_t SMALL_KEYS = 128;

// Whether small_item takes decode_item's (b, kvh) item: float32, every key in one piece (no
// split), no logit feature, bias or block mask (packed sequences only as the FlashAttention loop
// hands them over: lanes_attention), at least W/2 rows (its lanes) and at most SMALL_KEYS keys.
// AVX-512, measured (Intel Xeon, 1 thread, its time / decode_item's): the bundled model's
// (3, 12, 24, 32) 0.70×, (1, 12, 16, 64) 0.53×, (1, 12, 8, 64) 0.65×, a GQA 32/4 step on 64 keys
// 0.88×, on 128 keys 0.96×. AVX2 (8 lanes) only for short prefills: at least W queries per head
// and at most AVX2_LANE_KEYS keys (or packed sequences, whose lanes stop at their own). Measured
// (AMD EPYC, Zen 3; medians of 4 alternating processes, 1 / 2 threads, its time / the loops'):
// (1, 12, S, 32) S = 8: 0.81× / 0.92× (0.54× / 0.65× causal), S = 16: 0.63× / 0.94× (0.52× /
// 0.73×), S = 32: 0.84× / 0.86× (0.60× / 0.69×), S = 64: 0.97× / 0.96× (0.74× / 0.78×), S = 128
// 1.21× / 1.23× (0.83× / 0.98× causal: not taken); the bundled layer's masked (3, 12, 24, 32)
// 0.92× / 0.77×; its 52 tokens packed 0.78× / 0.86×; 9 sequences packed into 128 (D = 64) 0.91× /
// 0.90×; GQA 32/8, D = 128, S = 16 causal 0.62× / 0.57×, S = 64 1.02× / 0.93×. Decoding steps
// (fewer queries than lanes per head, G·Sq rows) stay with decode_item on AVX2: 1.0-2.2× (G = 4
// and 8 rows on 64-128 keys; Intel Xeon, the AVX2 build).
// (The builds without AVX, 'baseline' and 'generic', not measured: never taken there.)
constexpr int64_t AVX2_LANE_KEYS = 64;
#if defined(__AVX2__)
constexpr bool AVX2_LANES = true;
#else
constexpr bool AVX2_LANES = false;
#endif
inline bool small_item_fits(const Problem& P, int64_t rows, int64_t keys, const float* part) {
    const bool width_takes = W == 16 || (AVX2_LANES && P.Sq >= W && (keys <= AVX2_LANE_KEYS || P.seg));
    return width_takes && !part && P.softcap == 0.f && !P.alibi && !P.sinks && !P.tiles && !P.bias &&
           2 * rows >= W && keys <= SMALL_KEYS;
}

// dst[t·ld + c] = rows[c][t] for t, c < W: a W × W transpose (in registers with AVX2 and AVX-512).
inline void transpose_w(const float* const* rows, float* dst, int64_t ld) {
#if MH_VECTOR_FLOATS == 16
    transpose16(rows, dst, ld);
#elif MH_VECTOR_FLOATS == 8 && defined(__AVX__)
    transpose8(rows, dst, ld);
#else
    for (int t = 0; t < W; ++t)
        for (int c = 0; c < W; ++c) dst[t * ld + c] = rows[c][t];
#endif
}

// qt (D × W) = the rows at `rows` (W pointers to D floats) transposed.
inline void transposed(const float* const* rows, int64_t D, float* qt) {
    int64_t t0 = 0;
    for (; t0 + W <= D; t0 += W) {
        const float* at[W];
        for (int c = 0; c < W; ++c) at[c] = rows[c] + t0;
        transpose_w(at, qt + t0 * W, W);
    }
    for (int64_t t = t0; t < D; ++t)
        for (int c = 0; c < W; ++c) qt[t * W + c] = rows[c][t];
}

// The scores of keys [j, j + NK) (K rows at k, row stride ldk) for the W rows of qt (D × W): NK
// independent FMA chains along D, each FMA a broadcast K value times the rows' q.
template <int NK>
inline void lane_scores(const float* qt, int64_t D, const float* k, int64_t ldk, vf* acc) {
    for (int u = 0; u < NK; ++u) acc[u] = (vf){};
    for (int64_t t = 0; t < D; ++t) {
        const vf qv = load(qt + t * W);
        for (int u = 0; u < NK; ++u) acc[u] += k[u * ldk + t] * qv;
    }
}

// Columns [t0, t0 + NT) of o = p · v for the W rows of pt (n × W), each times inv: acc[u] is
// column t0 + u across the rows.
template <int NT>
inline void lane_outputs(const float* pt, int64_t n, const float* v, int64_t ldv, vf inv, vf* acc) {
    for (int u = 0; u < NT; ++u) acc[u] = (vf){};
    for (int64_t j = 0; j < n; ++j) {
        const vf p = load(pt + j * W);
        const float* vj = v + j * ldv;
        for (int u = 0; u < NT; ++u) acc[u] += vj[u] * p;
    }
    for (int u = 0; u < NT; ++u) acc[u] *= inv;
}

// decode_item for few keys (a short prefill: the layer at an encoder's sentence lengths), with
// the rows in the vector lanes: a block of up to W rows (row g·Sq + i: head kvh·G + g, query
// i) is computed at once, its scores held transposed (key-major, s[j·W + lane]), so the softmax's
// maxima and sums are vertical (no reduction across lanes per row, no per-row call), K and V are
// read once per block, and each product is an FMA of a broadcast K or V value with a vector of
// the rows' q or p; q and o cross between rows and lanes by W × W transposes. The arithmetic of
// decode_item's one chunk, but for the scale, applied to each score as it is stored (one rounding
// a score, as the FlashAttention loop's, not one per element of q): scores in base 2, -inf where
// masked, m = the row's maximum (0 where none), p = 2^(s - m), o = Σ p·v / Σ p. Keys [k0, k1)
// of the item; a block reads only those its rows' spans reach (a causal prefill's first rows,
// the first keys).
template <class TQ, class T>
void small_item(const Problem& P, Buffers& buf, int64_t b, int64_t kvh, int64_t k0, int64_t k1) {
    static_assert(std::is_same_v<TQ, float> && std::is_same_v<T, float>, "float32 only");
    const int64_t G = P.H / P.Hkv, D = P.D, Dv = P.Dv, Sq = P.Sq, rows = G * Sq, off = P.Sk - P.Sq;
    float* qt = buf.kt;  // (D, W): the block's q, transposed (wide_floats >= W·D)
    float* st = buf.s;  // (n, W): the block's scores, then probabilities (n·W <= SMALL_KEYS·W)
    float* ot = st + SMALL_KEYS * W;  // (W, W): W columns of o across the rows, then transposed
    float* orows = ot + W * W;
    const bool shared_mask = P.mask && P.ms[1] == 0 && P.ms[2] == 0;  // one byte a key (key padding)
    const uint8_t* mrows[W];
    const float* qrows[W];
    float* outs[W];
    for (int64_t r0 = 0; r0 < rows; r0 += W) {
        const int64_t R = std::min<int64_t>(W, rows - r0);
        vi klo, khi;  // each lane's keys [klo, khi): its span
        int64_t lo = k1, hi = k0;  // the block's keys: the hull of its rows' spans within [k0, k1)
        for (int64_t u = 0; u < W; ++u) {  // lanes past R repeat the last row (finite, never stored)
            const int64_t r = r0 + std::min(u, R - 1), g = r / Sq, i = r % Sq;
            int64_t a, e;
            span(P, b, i + off, a, e);  // packed: also within the row's own sequence
            klo[u] = int32_t(a);
            khi[u] = int32_t(e);
            lo = std::min(lo, std::max(a, k0));
            hi = std::max(hi, std::min(e, k1));
            mrows[u] = P.mask ? P.mask + b * P.ms[0] + (kvh * G + g) * P.ms[1] + i * P.ms[2] : nullptr;
            qrows[u] = P.q + b * P.qs[0] + (kvh * G + g) * P.qs[1] + i * P.qs[2];
            outs[u] = P.out + b * P.os[0] + (kvh * G + g) * P.os[1] + i * P.os[2];
        }
        transposed(qrows, D, qt);
        const int64_t n = std::max<int64_t>(hi - lo, 0);
        const float* kb = P.k + b * P.ks[0] + kvh * P.ks[1] + lo * P.ks[2];
        const float* vb = P.v + b * P.vs[0] + kvh * P.vs[1] + lo * P.vs[2];
        vf mx = splat(NEG_INF);
        auto finish = [&](int64_t j, vf s) {  // the structure and the mask, then s stored
            const int32_t c = int32_t(lo + j);
            vi keep = (klo <= c) & (khi > c);
            if (shared_mask) {
                if (!mrows[0][c * P.ms[3]]) keep = keep & 0;
            } else if (P.mask) {
                vi bytes;
                for (int u = 0; u < W; ++u) bytes[u] = mrows[u][c * P.ms[3]];
                keep = keep & (bytes != 0);
            }
            s = keep ? s * P.scale : splat(NEG_INF);  // scaled as stored: one rounding a score
            store(st + j * W, s);
            mx = vmax(mx, s);
        };
        vf acc[W];
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            lane_scores<8>(qt, D, kb + j * P.ks[2], P.ks[2], acc);
            for (int u = 0; u < 8; ++u) finish(j + u, acc[u]);
        }
        for (; j < n; ++j) {
            lane_scores<1>(qt, D, kb + j * P.ks[2], P.ks[2], acc);
            finish(j, acc[0]);
        }
        const vf m_use = mx == splat(NEG_INF) ? splat(0.f) : mx;  // no allowed key: p = 0, no NaN
        vf l = (vf){};
        for (j = 0; j < n; ++j) {
            const vf p = exp2v(load(st + j * W) - m_use);
            store(st + j * W, p);
            l += p;
        }
        const vf inv = l > 0.f ? 1.f / l : splat(0.f);
        int64_t t0 = 0;
        for (; t0 + W <= Dv; t0 += W) {  // W columns: across the lanes, then transposed into rows
            lane_outputs<W>(st, n, vb + t0, P.vs[2], inv, acc);
            const float* cols[W];
            for (int u = 0; u < W; ++u) {
                store(ot + u * W, acc[u]);
                cols[u] = ot + u * W;
            }
            transpose_w(cols, orows, W);
            for (int64_t w = 0; w < R; ++w) store(outs[w] + t0, load(orows + w * W));
        }
        for (; t0 < Dv; ++t0) {
            lane_outputs<1>(st, n, vb + t0, P.vs[2], inv, acc);
            for (int64_t w = 0; w < R; ++w) outs[w][t0] = acc[0][w];
        }
        for (int64_t w = 0; w < R; ++w) {
            const int64_t r = r0 + w;
            store_lse(P, b, kvh * G + r / Sq, r % Sq, mx[w], l[w]);
        }
    }
}

// Decoding: few query rows per K/V head (G heads × Sq queries), so K and V are streamed
// once, in place, with no packing: scores are dot products along D. An item is
// (b, K/V head, key split); with fewer heads than threads the keys are split and the
// partial (m, l, o) merged at the end (flash-decoding). TQ: q's and out's element type, T:
// K's and V's (float, bf16, f16; P's pointers hold data of those types).
template <class TQ, class T>
void decode_item(const Problem& P, Buffers& buf, int64_t b, int64_t kvh, int64_t k0, int64_t k1, float* part) {
    const int64_t G = P.H / P.Hkv, D = P.D, Dv = P.Dv, Sq = P.Sq, rows = G * Sq;
    const int64_t off = P.Sk - P.Sq;
    if constexpr (std::is_same_v<TQ, float> && std::is_same_v<T, float>) {
        int64_t lo, hi;
        key_range(P, 0, Sq, lo, hi);
        lo = std::max(lo, k0);
        hi = std::max(std::min(hi, k1), lo);
        if (small_item_fits(P, rows, hi - lo, part)) return small_item<TQ, T>(P, buf, b, kvh, lo, hi);
    }
    for (int64_t g = 0; g < G; ++g) {  // row g·Sq + i: head kvh·G + g, query i
        const TQ* src = reinterpret_cast<const TQ*>(P.q) + b * P.qs[0] + (kvh * G + g) * P.qs[1];
        for (int64_t i = 0; i < Sq; ++i)
            for (int64_t t = 0; t < D; ++t)
                buf.qbuf[(g * Sq + i) * D + t] = to_f32(src[i * P.qs[2] + t]) * P.scale;
    }
#if MH_VECTOR_FLOATS == 8 && defined(__AVX2__)
    // q·kᵀ register-blocked in every type (float32: the step's attention 0.92×, 0.85× and 0.87×
    // the time of the per-row dot products below with 4, 2 and 1 heads per K/V head, cold,
    // paired); p·v blocked in half precision only: float32's V is read faster by pv_stream
    // (measured cold: its column passes cost more than the per-row reads of L1 they save,
    // 1.09×; rows in pairs and 32 columns at a time, 1.08×).
    constexpr bool wide = std::is_same_v<T, float>;
    const bool blocked = !wide && D % (2 * W) == 0 && Dv % (2 * W) == 0;  // both products
    const bool qk_block = blocked || (wide && D % W == 0);
    constexpr bool split = PARTS<T> == 2;  // q and o in split_even_odd's order (buf.kt: at least 8·D floats)
    if (blocked && split)
        for (int64_t r = 0; r < rows; ++r) {
            split_even_odd(buf.qbuf + r * D, 1, D, buf.kt);
            std::memcpy(buf.qbuf + r * D, buf.kt, sizeof(float) * D);
        }
#elif MH_VECTOR_FLOATS == 16
    // q·kᵀ register-blocked in every type (qk_rows: 4 rows × 4 keys), p·v by the pv tiles below.
    const bool qk_block = D % (PARTS<T> * W) == 0;
    if (qk_block && PARTS<T> == 2)  // q in split_even_odd's order, as bf16 K is widened
        for (int64_t r = 0; r < rows; ++r) {
            split_even_odd(buf.qbuf + r * D, 1, D, buf.kt);
            std::memcpy(buf.qbuf + r * D, buf.kt, sizeof(float) * D);
        }
#endif
    for (int64_t r = 0; r < rows; ++r) { buf.m[r] = NEG_INF; buf.l[r] = 0.f; }
    std::memset(buf.o, 0, sizeof(float) * rows * Dv);
    int64_t lo, hi;
    key_range(P, 0, Sq, lo, hi);
    lo = std::max(lo, k0);
    hi = std::min(hi, k1);
    const T* kb = reinterpret_cast<const T*>(P.k) + b * P.ks[0] + kvh * P.ks[1];
    const T* vb = reinterpret_cast<const T*>(P.v) + b * P.vs[0] + kvh * P.vs[1];
    const int64_t lds = score_stride(hi - lo);
    for (int64_t c0 = lo; c0 < hi; c0 += KD) {
        const int64_t n = std::min(KD, hi - c0), width = (n + W - 1) / W * W;
#if MH_VECTOR_FLOATS == 8 && defined(__AVX2__)
        if (qk_block) {
            qk_blocked(buf.qbuf, rows, D, kb + c0 * P.ks[2], P.ks[2], n, buf.s, lds);
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t g = r / Sq, i = r % Sq;
                const uint8_t* mrow = P.mask ? P.mask + b * P.ms[0] + (kvh * G + g) * P.ms[1] + i * P.ms[2] : nullptr;
                row_update(P, buf.s + r * lds, width, n, c0, i + off, mrow, buf.m[r], buf.l[r], buf.o + r * Dv);
            }
            if (blocked)
                pv_blocked(buf.s, lds, rows, n, vb + c0 * P.vs[2], P.vs[2], buf.o, Dv, Dv);
            else
                pv_stream(buf.s, lds, rows, n, vb + c0 * P.vs[2], P.vs[2], buf.o, Dv, Dv, buf.kt);
            continue;
        }
#endif
        int64_t j = 0;
#if MH_VECTOR_FLOATS == 16
        if (qk_block) {
            qk_blocked(buf.qbuf, rows, D, kb + c0 * P.ks[2], P.ks[2], n, buf.s, lds, vb + c0 * P.vs[2], P.vs[2]);
            j = n;
        }
#endif
        if (D % W == 0)  // W keys at a time, their W sums reduced together
            for (; j + W <= n; j += W) {
                const T* kj = kb + (c0 + j) * P.ks[2];
                if constexpr (!std::is_same_v<T, float>) {
                    if (rows > 1) {  // half precision: the W keys widened once (buf.kt, L1), read by every row
                        for (int64_t s = 0; s < W; ++s)
                            for (int64_t t = 0; t < D; t += W) store(buf.kt + s * D + t, load_f(kj + s * P.ks[2] + t));
                        for (int64_t r = 0; r < rows; ++r)
                            store(buf.s + r * lds + j, dot_w(buf.qbuf + r * D, buf.kt, D, D));
                        continue;
                    }
                }
                for (int64_t r = 0; r < rows; ++r)
                    store(buf.s + r * lds + j, dot_w(buf.qbuf + r * D, kj, P.ks[2], D));
            }
        for (; j < n; ++j) {
            const T* kr = kb + (c0 + j) * P.ks[2];
            for (int64_t r = 0; r < rows; ++r) buf.s[r * lds + j] = dot(buf.qbuf + r * D, kr, D);
        }
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t g = r / Sq, i = r % Sq;
            const uint8_t* mrow = P.mask ? P.mask + b * P.ms[0] + (kvh * G + g) * P.ms[1] + i * P.ms[2] : nullptr;
            row_update(P, buf.s + r * lds, width, n, c0, i + off, mrow, buf.m[r], buf.l[r], buf.o + r * Dv);
        }
#if MH_VECTOR_FLOATS == 16
        for (int64_t r0 = 0; r0 < rows; r0 += MR)
            pv(buf.s + r0 * lds, lds, std::min<int64_t>(MR, rows - r0), n, vb + c0 * P.vs[2], P.vs[2],
               buf.o + r0 * Dv, Dv, Dv);
#else
        pv_stream(buf.s, lds, rows, n, vb + c0 * P.vs[2], P.vs[2], buf.o, Dv, Dv, buf.kt);
#endif
    }
#if MH_VECTOR_FLOATS == 8 && defined(__AVX2__)
    if (blocked && split)  // o's columns back in order
        for (int64_t r = 0; r < rows; ++r) {
            join_even_odd(buf.o + r * Dv, Dv, buf.kt);
            std::memcpy(buf.o + r * Dv, buf.kt, sizeof(float) * Dv);
        }
#endif
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
        store_lse(P, b, kvh * G + g, i, buf.m[r], buf.l[r]);
        TQ* dst = reinterpret_cast<TQ*>(P.out) + b * P.os[0] + (kvh * G + g) * P.os[1] + i * P.os[2];
        for (int64_t t = 0; t < Dv; ++t) dst[t] = from_f32<TQ>(buf.o[r * Dv + t] * inv);
    }
}

// Floats of decode_item's scratch buffer (buf.kt): W widened keys of K, PV_KEYS rows of V, or one
// row of q or o reordered (split_even_odd / join_even_odd).
inline int64_t wide_floats(int64_t D, int64_t Dv) { return std::max(W * D, PV_KEYS * Dv); }

// Merge the key splits of (b, kvh): weights 2^(m_s - max m) as in the online softmax; out of type T
// (summed in float32, rounded once).
template <class T>
void merge_splits(const Problem& P, const float* part, int64_t splits, int64_t b, int64_t kvh) {
    const int64_t G = P.H / P.Hkv, Dv = P.Dv, Sq = P.Sq, rows = G * Sq, stride = rows * (Dv + 2);
    for (int64_t r = 0; r < rows; ++r) {
        float top = NEG_INF;
        for (int64_t sp = 0; sp < splits; ++sp) top = std::max(top, part[sp * stride + r * (Dv + 2) + Dv]);
        const float use = top == NEG_INF ? 0.f : top;
        float total = 0.f;
        const int64_t g = r / Sq, i = r % Sq;
        T* dst = reinterpret_cast<T*>(P.out) + b * P.os[0] + (kvh * G + g) * P.os[1] + i * P.os[2];
        float weights[64];  // the splits' weights (key_splits: at most 64)
        for (int64_t sp = 0; sp < splits; ++sp) {
            const float* src = part + sp * stride + r * (Dv + 2);
            weights[sp] = exp2v(splat(src[Dv] - use))[0];
            total += src[Dv + 1] * weights[sp];
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t t = 0; t < Dv; ++t) {
            float acc = 0.f;
            for (int64_t sp = 0; sp < splits; ++sp) acc += part[sp * stride + r * (Dv + 2) + t] * weights[sp];
            dst[t] = from_f32<T>(acc * inv);
        }
        store_lse(P, b, kvh * G + g, i, use, total);
    }
}

// Key splits of each (b, K/V head): enough items (SPLIT_ITEMS) to feed the threads of a large
// machine, each split keeping at least 512 keys. The splits fix the summation order, so they
// depend on the problem only, never on the thread count: results are bitwise the same with
// any number of threads (as the prefill kernel's).
constexpr int64_t SPLIT_ITEMS = 64;
inline int64_t key_splits(int64_t heads, int64_t keys) {
    return std::clamp<int64_t>(std::min<int64_t>((SPLIT_ITEMS + heads - 1) / std::max<int64_t>(heads, 1), keys / 512),
                               1, 64);
}

}  // namespace

namespace {

// A parallel region of `threads` threads, each holding decode_item's buffers for `rows` rows of P
// (FlushToZero on), that runs body(buf) on every thread once every buffer is allocated (the
// body's worksharing loops bind to this region): 0, or -1 if a thread could not allocate (then
// no thread runs the body).
template <class F>
int with_item_buffers(const Problem& P, int64_t rows, int threads, F&& body) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const FlushToZero ftz;  // this thread, for the loop (restored as it ends)
        Buffers buf{alloc(rows * P.D), alloc(wide_floats(P.D, P.Dv)), alloc(rows * score_stride(KD)), alloc(rows),
                    alloc(rows), alloc(rows * P.Dv)};
        if (!buf.ok()) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) body(buf);
        buf.release();
    }
    return failed ? -1 : 0;
}

// The body of mh_decode_f32 (_bf16, _f16): q, k, v and out of type T.
template <class T>
int decode_attention(const void* q, const void* k, const void* v, void* out, float* lse, const uint8_t* mask,
                     const int64_t* dims, const int64_t* strides, float scale, int causal, int64_t window,
                     int threads) {
    const Problem P = make_problem(static_cast<const float*>(q), static_cast<const float*>(k),
                                   static_cast<const float*>(v), static_cast<float*>(out), lse, mask, dims, strides,
                                   scale, causal, window);
    if (!valid(P)) return -2;
    const int64_t G = P.H / P.Hkv, rows = G * P.Sq, heads = P.B * P.Hkv;
    const int64_t splits = key_splits(heads, P.Sk);
    const int64_t per = (P.Sk + splits - 1) / splits, items = heads * splits;
    float* part = nullptr;
    if (splits > 1 && !(part = alloc(items * rows * (P.Dv + 2)))) return -1;
    const int code = with_item_buffers(P, rows, threads, [&](Buffers& buf) {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; ++it) {
            const int64_t sp = it % splits, head = it / splits;
            decode_item<T, T>(P, buf, head / P.Hkv, head % P.Hkv, sp * per, std::min(P.Sk, (sp + 1) * per),
                              part ? part + it * rows * (P.Dv + 2) : nullptr);
        }
        if (part) {
#pragma omp for schedule(static)
            for (int64_t head = 0; head < heads; ++head)
                merge_splits<T>(P, part + head * splits * rows * (P.Dv + 2), splits, head / P.Hkv, head % P.Hkv);
        }
    });
    std::free(part);
    return code;
}

}  // namespace

namespace mh {

// The FlashAttention loop's float32 problems that small_item computes whole (see attention()):
// every (b, K/V head) pair is one item of at most SMALL_KEYS keys and at least W/2 rows, with
// no logit feature, bias or block mask, and at most LANE_ROWS rows unless packed (the rows the
// decoding loop takes from multihead.attention: LANE_ROWS in attention.py, measured there);
// packed sequences (P.seg) are limited by span() lane by lane, so a block reads only its rows'
// sequences. Short packed sentences (an encoder's batch without padding) run there: the
// bundled model's 3 sentences of 24, 18 and 10 tokens packed into 52, (1, 12, 52, 32), took
// 0.50-0.57x the FlashAttention loop's time (Intel Xeon, 1 thread, paired, two runs).
constexpr int64_t LANE_ROWS = 256;
bool lanes_take(const Problem& P) {
    const int64_t rows = P.H / P.Hkv * P.Sq;
    return !P.panels && P.Sk <= SMALL_KEYS && (P.seg || rows <= LANE_ROWS) && small_item_fits(P, rows, P.Sk, nullptr);
}

int lanes_attention(const Problem& P, int threads) {
    const int64_t items = P.B * P.Hkv;
    // small_item reads only its q tile and its scores, which fit the buffers of W/2 rows (the
    // fewest it takes): not the buffers of every row of a long packed item (MiBs a thread)
    return with_item_buffers(P, W / 2, threads, [&](Buffers& buf) {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; ++it) small_item<float, float>(P, buf, it / P.Hkv, it % P.Hkv, 0, P.Sk);
    });
}

}  // namespace mh

// As mh_attention_f32, for few query rows per K/V head (G·Sq): see decode_item.
extern "C" int mh_decode_f32(const float* q, const float* k, const float* v, float* out, float* lse,
                             const uint8_t* mask, const int64_t* dims, const int64_t* strides, float scale,
                             int causal, int64_t window, int threads) {
    return decode_attention<float>(q, k, v, out, lse, mask, dims, strides, scale, causal, window, threads);
}

// As mh_decode_f32 with q, k, v and out bfloat16 (uint16 bits), lse float32.
extern "C" int mh_decode_bf16(const void* q, const void* k, const void* v, void* out, float* lse,
                              const uint8_t* mask, const int64_t* dims, const int64_t* strides, float scale,
                              int causal, int64_t window, int threads) {
    return decode_attention<bf16>(q, k, v, out, lse, mask, dims, strides, scale, causal, window, threads);
}

// As mh_decode_f32 with q, k, v and out float16 (uint16 bits), lse float32.
extern "C" int mh_decode_f16(const void* q, const void* k, const void* v, void* out, float* lse,
                             const uint8_t* mask, const int64_t* dims, const int64_t* strides, float scale,
                             int causal, int64_t window, int threads) {
    return decode_attention<f16>(q, k, v, out, lse, mask, dims, strides, scale, causal, window, threads);
}

// ---------------------------------------------------------------------------------------
// Few-row linear layers (decoding): out_i (M, N_i) = x (M, K) · W_iᵀ (+ b_i) for `count`
// weights at once (q, k and v projections share x), M <= MAX_STEP_ROWS (8). The weights' rows, all
// weights together, are taken by the threads in chunks (gemv_chunks); each weight row is read once
// and multiplied with the M rows of x held in L1. Bandwidth-bound: this streams the weights.

namespace {

// Weight rows multiplied per pass: R·M accumulators (AVX-512: at most 16 of 32 registers;
// AVX2: at most 8 of 16).

template <int M>
constexpr int gemv_block() {
    if constexpr (W == 16) return M <= 4 ? 4 : 2;
    return M <= 2 ? 4 : M <= 4 ? 2 : 1;
}

template <int R, int M>
inline void zero(vf (&acc)[R][M]) {
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) acc[i][m] = (vf){};
}

// Bytes ahead that the AVX-512 GEMV prefetches half precision weights (into L2; past the end
// harmless): as GEMV_AHEAD for AVX2, the next blocks' rows, whose pages the hardware prefetcher
// reaches late. The bf16 decoding step (issue layer, cold, 200 paired rounds, Intel Xeon): the
// projections 0.82×, the step 0.88× (16 KiB the same, 64 KiB 0.89×, 4 KiB 0.97×, into L1 0.88×);
// float32 weights no faster with it (1.00×), so they have none.
constexpr int64_t GEMV16_AHEAD = 32 * 1024;

// TW: the weights' and bias's type (float, bf16, f16: widened as loaded); x and out float32.
template <int M, class TW>
void gemv_rows(const float* __restrict x, int64_t K, const TW* __restrict w, int64_t rows, const TW* bias,
               float* __restrict out, int64_t ldo) {
    constexpr int R = gemv_block<M>();
    int64_t r = 0;
    for (; r + R <= rows; r += R) {
        const TW* w0 = w + r * K;
        vf acc[R][M];
        zero(acc);
        int64_t t = 0;
        for (; t + W <= K; t += W) {
            vf wv[R];
#if MH_VECTOR_FLOATS == 16
            if constexpr (!std::is_same_v<TW, float>)  // half precision: GEMV16_AHEAD
                if ((t * int64_t(sizeof(TW))) % 64 == 0)
#pragma GCC unroll 4
                    for (int i = 0; i < R; ++i)
                        _mm_prefetch(reinterpret_cast<const char*>(w0 + i * K + t) + GEMV16_AHEAD, _MM_HINT_T1);
#endif
#pragma GCC unroll 4
            for (int i = 0; i < R; ++i) wv[i] = load_f(w0 + i * K + t);
#pragma GCC unroll 8
            for (int m = 0; m < M; ++m) {
                vf xm = load(x + m * K + t);
#pragma GCC unroll 4
                for (int i = 0; i < R; ++i) acc[i][m] += wv[i] * xm;
            }
        }
        for (int i = 0; i < R; ++i)
            for (int m = 0; m < M; ++m) {
                float s = hsum(acc[i][m]);
                for (int64_t u = t; u < K; ++u) s += to_f32(w0[i * K + u]) * x[m * K + u];
                out[m * ldo + r + i] = s + (bias ? to_f32(bias[r + i]) : 0.f);
            }
    }
    for (; r < rows; ++r)
        for (int m = 0; m < M; ++m) out[m * ldo + r] = dot(x + m * K, w + r * K, K) + (bias ? to_f32(bias[r]) : 0.f);
}

#if MH_VECTOR_FLOATS == 8 && defined(__AVX2__)
// Bytes ahead that the bf16 GEMV prefetches its weights (into L2; past the end they are
// harmless, prefetches never fault): the rows of the next blocks, whose pages the hardware
// prefetcher would reach only when their first line is read. The bf16 decoding step (issue
// layer, cold, paired) 0.955× the time without it with 1 row of x, 0.93× with 2, 0.87× with 4;
// 16 and 64 KiB about the same, 1-4 KiB slower (1.0-1.1×). The float32 GEMV is slower with it
// (1.04-1.05×) and has none.
constexpr int64_t GEMV_AHEAD = 32 * 1024;

// bfloat16 weights (AVX2): 16 weights per load, widened by two integer operations into their
// even-indexed values (the bits shifted left by 16) and their odd ones (the high halves
// kept), instead of a zero-extension and a shift per 8. The dot product is then taken
// against x de-interleaved the same way (xs: per 16 values, the 8 even ones, then the 8 odd
// ones; see split_even_odd), so only the order of the sum changes. K a multiple of 16.
template <int M>
void gemv_rows_bf16(const float* __restrict xs, int64_t K, const bf16* __restrict w, int64_t rows,
                    const bf16* bias, float* __restrict out, int64_t ldo) {
    constexpr int R = gemv_block<M>();
    const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
    int64_t r = 0;
    for (; r + R <= rows; r += R) {
        const bf16* w0 = w + r * K;
        vf acc[R][M];
        zero(acc);
        for (int64_t t = 0; t < K; t += 2 * W) {
            vf even[R], odd[R];
#pragma GCC unroll 4
            for (int i = 0; i < R; ++i) {
                if ((t & 31) == 0)  // once per 64-byte line: the line GEMV_AHEAD bytes on, into L2
                    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(w0 + i * K + t) +
                                                               GEMV_AHEAD), _MM_HINT_T1);
                const __m256i bits = _mm256_loadu_si256((const __m256i*)(w0 + i * K + t));
                even[i] = (vf)_mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
                odd[i] = (vf)_mm256_castsi256_ps(_mm256_and_si256(bits, high));
            }
#pragma GCC unroll 8
            for (int m = 0; m < M; ++m) {
                const vf xe = load(xs + m * K + t), xo = load(xs + m * K + t + W);
#pragma GCC unroll 4
                for (int i = 0; i < R; ++i) acc[i][m] += even[i] * xe + odd[i] * xo;
            }
        }
        for (int i = 0; i < R; ++i)
            for (int m = 0; m < M; ++m)
                out[m * ldo + r + i] = hsum(acc[i][m]) + (bias ? to_f32(bias[r + i]) : 0.f);
    }
    for (; r < rows; ++r)
        for (int m = 0; m < M; ++m) {
            vf acc = (vf){};
            for (int64_t t = 0; t < K; t += 2 * W) {
                const __m256i bits = _mm256_loadu_si256((const __m256i*)(w + r * K + t));
                acc += (vf)_mm256_castsi256_ps(_mm256_slli_epi32(bits, 16)) * load(xs + m * K + t)
                       + (vf)_mm256_castsi256_ps(_mm256_and_si256(bits, high)) * load(xs + m * K + t + W);
            }
            out[m * ldo + r] = hsum(acc) + (bias ? to_f32(bias[r]) : 0.f);
        }
}

#endif

// f(std::integral_constant<int, M>) for 1 <= M <= MAX_STEP_ROWS (8): the GEMV's row count as a constant.
template <class F>
inline void by_rows(int64_t M, F&& f) {
    switch (M) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        case 6: f(std::integral_constant<int, 6>{}); break;
        case 7: f(std::integral_constant<int, 7>{}); break;
        default: f(std::integral_constant<int, 8>{}); break;
    }
}
static_assert(MAX_STEP_ROWS == 8, "by_rows covers 1 to MAX_STEP_ROWS rows");

// xs: x de-interleaved by split_even_odd where splits_x<TW>(K) (gemv_rows_bf16), else null.
template <class TW>
void gemv_any(int64_t M, const float* x, const float* xs, int64_t K, const TW* w, int64_t rows, const TW* bias,
              float* out, int64_t ldo) {
#if MH_VECTOR_FLOATS == 8 && defined(__AVX2__)
    if constexpr (std::is_same_v<TW, bf16>) {
        if (xs) {
            by_rows(M, [&](auto m) { gemv_rows_bf16<decltype(m)::value>(xs, K, w, rows, bias, out, ldo); });
            return;
        }
    }
#endif
    by_rows(M, [&](auto m) { gemv_rows<decltype(m)::value>(x, K, w, rows, bias, out, ldo); });
}

// Whether the GEMV of TW weights with rows of K values reads x de-interleaved (gemv_rows_bf16).
template <class TW>
constexpr bool splits_x(int64_t K) {
#if MH_VECTOR_FLOATS == 8 && defined(__AVX2__)
    return std::is_same_v<TW, bf16> && K % (2 * W) == 0;
#else
    (void)K;
    return false;
#endif
}

// Rows [begin, end) of out_i (M, N_i; row stride ldo_i) = x · W_iᵀ + b_i, the rows of all
// weights counted together (W_0's first, then W_1's, ...).
template <class TW>
void gemv_range(int64_t begin, int64_t end, int64_t M, const float* x, const float* xs, int64_t K, int64_t count,
                const TW* const* W, const int64_t* N, const TW* const* bias, float* const* out,
                const int64_t* ldo) {
    int64_t base = 0;
    for (int64_t i = 0; i < count; ++i) {
        const int64_t lo = std::max(begin, base) - base, hi = std::min(end, base + N[i]) - base;
        if (hi > lo)
            gemv_any(M, x, xs, K, W[i] + lo * K, hi - lo, bias[i] ? bias[i] + lo : nullptr, out[i] + lo, ldo[i]);
        base += N[i];
    }
}

int64_t total_rows(int64_t count, const int64_t* N) {
    int64_t total = 0;
    for (int64_t i = 0; i < count; ++i) total += N[i];
    return total;
}

// Weight bytes per chunk that the threads of a few-row GEMV take in turn (gemv_chunks).
constexpr int64_t CHUNK_BYTES = 256 * 1024;

// The rows per chunk of gemv_chunks for rows of K values of TW: CHUNK_BYTES, a multiple of 4.
template <class TW>
int64_t chunk_rows(int64_t K) {
    return std::max<int64_t>(4, CHUNK_BYTES / (K * static_cast<int64_t>(sizeof(TW))) / 4 * 4);
}

// gemv_range over every row, in chunks of `chunk` rows that the calling threads take in turn from
// `next` (0 at first, shared): a thread that the OS deschedules (another process on its core)
// leaves its chunks to the others instead of holding them all at the end. The chunks do not
// depend on how many threads take them and each output row is computed by one thread, so the
// results are the same bits on any thread count.
template <class TW>
void gemv_chunks(std::atomic<int64_t>& next, int64_t chunk, int64_t M, const float* x, const float* xs, int64_t K,
                 int64_t count, const TW* const* W, const int64_t* N, const TW* const* bias, float* const* out,
                 const int64_t* ldo) {
    const int64_t total = total_rows(count, N);
    for (int64_t begin = next.fetch_add(chunk); begin < total; begin = next.fetch_add(chunk))
        gemv_range(begin, std::min(total, begin + chunk), M, x, xs, K, count, W, N, bias, out, ldo);
}

}  // namespace

extern "C" int mh_max_step_rows() { return MAX_STEP_ROWS; }

namespace {

// Whether every row's length L_b lies in [0, capacity): it can take one more token.
bool rows_have_room(const int64_t* lengths, int64_t rows, int64_t capacity) {
    for (int64_t b = 0; b < rows; ++b)
        if (lengths[b] < 0 || lengths[b] >= capacity) return false;
    return true;
}

// slot_pos[b, L_b] = L_b, then lengths[b] = L_b + 1: a cache's counters after one token per row.
void advance(int64_t* lengths, int64_t* slot_pos, int64_t rows, int64_t ld) {
    for (int64_t b = 0; b < rows; ++b) {
        const int64_t n = lengths[b];
        slot_pos[b * ld + n] = n;
        lengths[b] = n + 1;
    }
}

}  // namespace

// A KV cache's counters after one token per row (multihead.KVCache.commit calls this; the eager
// fused step's plan has mh_decode_step do the same): slot_pos[b, L_b] = L_b, then lengths[b] =
// L_b + 1, with L_b = lengths[b]. Every row is checked first (0 <= L_b < capacity): on -2
// nothing is written.
extern "C" int mh_advance_counters(int64_t* lengths, int64_t* slot_pos, int64_t rows, int64_t ld, int64_t capacity) {
    if (!rows_have_room(lengths, rows, capacity)) return -2;
    advance(lengths, slot_pos, rows, ld);
    return 0;
}

namespace {

// How many threads a few-row GEMV or a fused decoding step takes: all it is given, or one where
// one has been faster. A machine's other processes can make the threads wait for one another
// (measured on a 2-core AMD EPYC beside one CPU-bound process: the 0.5B Llama's decoding steps ran
// at 5.1 tokens/s with the MLP and LM head projections on 2 threads, at 11.3 on 1; idle, 13.6
// and 10.3). So calls of at least TIMED_BYTES of weights are timed, per kind of call and size
// class (log2 of the bytes): each class keeps a moving average of the time per byte on all
// threads and on one and runs the faster; now and then it runs the other, to see a change: after
// EXPLORE_MIN calls, and twice as long after each try that confirms the choice (up to
// EXPLORE_MAX). The work is cut the same way whatever the count (gemv_chunks; the attention's
// items), so the results are the same bits.
constexpr int64_t TIMED_BYTES = int64_t{1} << 20;
constexpr int SIZE_CLASSES = 48;
constexpr uint32_t EXPLORE_MIN = 16, EXPLORE_MAX = 1024;

struct ThreadChoice {
    std::atomic<double> ns_per_byte[2];  // [0]: all threads, [1]: one; 0 until measured
    std::atomic<uint32_t> calls, interval{EXPLORE_MIN};
};
ThreadChoice linear_choices[SIZE_CLASSES], step_choices[SIZE_CLASSES];

int size_class(int64_t bytes) {
    int c = 0;
    while (bytes > 1 && c < SIZE_CLASSES - 1) bytes >>= 1, ++c;
    return c;
}

// The slot the faster so far: 0 (all threads) or 1 (one); -1 while either is unmeasured.
int best_slot(const ThreadChoice& choice) {
    const double all = choice.ns_per_byte[0].load(std::memory_order_relaxed);
    const double one = choice.ns_per_byte[1].load(std::memory_order_relaxed);
    if (all == 0.0 || one == 0.0) return -1;
    return one < all ? 1 : 0;
}

// The slot this call runs: the best, or the other on an exploring call.
int pick_slot(ThreadChoice& choice) {
    if (choice.ns_per_byte[0].load(std::memory_order_relaxed) == 0.0) return 0;
    const int best = best_slot(choice);
    if (best < 0) return 1;
    const uint32_t n = choice.calls.fetch_add(1, std::memory_order_relaxed) + 1;
    return n % choice.interval.load(std::memory_order_relaxed) == 0 ? 1 - best : best;
}

// A call's time per byte into its slot's moving average. One sample moves an estimate by at most
// 2× its weight (a sample is capped at twice the estimate): a lone slow call (the VM's hiccup)
// does not flip the choice, a slowdown that lasts does within a few calls. When the choice
// changes, the other slot is tried again soon (EXPLORE_MIN); an explored slot that confirms the
// choice doubles the wait before the next try.
void record(ThreadChoice& choice, int slot, double ns_per_byte) {
    const int best = best_slot(choice);
    const double old = choice.ns_per_byte[slot].load(std::memory_order_relaxed);
    const double keep = old == 0.0 ? 0.0 : slot == best ? 0.75 : 0.5;  // an explored slot's estimate is older
    const double sample = old == 0.0 ? ns_per_byte : std::min(ns_per_byte, 2.0 * old);
    choice.ns_per_byte[slot].store(keep * old + (1.0 - keep) * sample, std::memory_order_relaxed);
    if (best < 0) return;
    const uint32_t interval = choice.interval.load(std::memory_order_relaxed);
    if (best_slot(choice) != best)
        choice.interval.store(EXPLORE_MIN, std::memory_order_relaxed);
    else if (slot != best)
        choice.interval.store(std::min(EXPLORE_MAX, 2 * interval), std::memory_order_relaxed);
}

// One call's thread count, picked from `table` (linear_choices or step_choices) for `bytes` of
// weights, and its timing: threads() for the parallel region, then done() once it has run.
class TimedThreads {
  public:
    TimedThreads(ThreadChoice* table, int threads, int64_t bytes)
        : choice_(threads > 1 && bytes >= TIMED_BYTES ? &table[size_class(bytes)] : nullptr),
          slot_(choice_ ? pick_slot(*choice_) : 0), threads_(slot_ == 1 ? 1 : threads), bytes_(bytes),
          start_(std::chrono::steady_clock::now()) {}
    int threads() const { return threads_; }
    void done() const {
        if (!choice_) return;
        const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start_;
        record(*choice_, slot_, took.count() / static_cast<double>(bytes_));
    }

  private:
    ThreadChoice* choice_;
    int slot_, threads_;
    int64_t bytes_;
    std::chrono::steady_clock::time_point start_;
};

}  // namespace

extern "C" int mh_linear_few_rows_f32(const float* x, int64_t M, int64_t K, int64_t count, const float* const* W,
                                      const int64_t* N, const float* const* bias, float* const* out, int threads) {
    if (M < 1 || M > MAX_STEP_ROWS || K < 1 || count < 1) return -2;
    const TimedThreads timed(linear_choices, threads, total_rows(count, N) * K * static_cast<int64_t>(sizeof(float)));
    std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(timed.threads())
    gemv_chunks(next, chunk_rows<float>(K), M, x, nullptr, K, count, W, N, bias, out, N);
    timed.done();
    return 0;
}

// ---------------------------------------------------------------------------------------
// One whole decoding step of a layer, one token per row (B <= MAX_STEP_ROWS), in one parallel region
// (on all threads or on one: TimedThreads):
//
//   qkv = x · [W_q; W_k; W_v]ᵀ + b          (B, (H + 2·Hkv)·D)   weights in chunks over threads
//   RoPE on q and k at each row's position lengths[b] - starts[b]; k, v written to slot lengths[b]
//   heads = attention(q, cache[starts[b] : lengths[b] + 1])   (decode_item, keys split if few heads;
//   starts null: 0, no left padding)
//   y = heads · W_oᵀ + b_o                    (B, E)
//   given slot_pos (B rows of slot_ld): the counters advanced, as mh_advance_counters;
//   else by the caller (KVCache.commit)
//
// Nothing is written to the cache unless the step runs whole (every buffer is allocated
// first). `saved` (or null): (B, 2, Hkv, D) of T, receives the written slots' old K and V,
// so that a caller that fails after the step can put the cache back bitwise.
//
// The caller has checked every shape and that each row has room (lengths[b] < capacity;
// checked here again, before anything is written, where slot_pos is given).

namespace {

// QK-norm of one head's vector v (D floats), in place, as multihead.RMSNorm computes it in float32:
// v · (1 / sqrt(mean(v²) + eps)) · w, with w = 1 + weight where `offset` (Gemma), weight (D) of T.
template <class T>
void rms_norm(float* v, int64_t D, const T* weight, float eps, bool offset) {
    float squares = 0.f;
    for (int64_t i = 0; i < D; ++i) squares += v[i] * v[i];
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(D) + eps);
    for (int64_t i = 0; i < D; ++i) {
        const float w = to_f32(weight[i]);
        v[i] = v[i] * inv * (offset ? 1.f + w : w);
    }
}

// The body of mh_decode_step_f32 (_bf16, _f16): x, the weights and biases, the cache and y of
// type T; RoPE tables float32. In half precision x is widened once (B·E values), the weights
// and the cache are widened as loaded, and q, k, v, the heads and y are float32 until y is
// stored (k and v rounded to T as they are written into the cache, as the unfused step does).
template <class T>
int decode_step(const T* x, int64_t B, int64_t E, const T* const* W, const T* const* bias, int64_t H, int64_t Hkv,
                int64_t D, const float* rope_cos, const float* rope_sin, int64_t rotary_dim, int interleaved,
                const T* const* norms, float norm_eps, int norm_mode, T* cache_k, T* cache_v,
                const int64_t* cache_strides, int64_t* lengths, float scale, int64_t window, const int64_t* starts,
                T* y, T* saved, int threads, int64_t* slot_pos, int64_t slot_ld, int64_t capacity) {
    if (B < 1 || B > MAX_STEP_ROWS || Hkv < 1 || H % Hkv != 0 || D < 1 || rotary_dim % 2 != 0 || rotary_dim > D ||
        window < 0)
        return -2;
    for (int64_t b = 0; starts && b < B; ++b)  // each row's first slot: at most its new token's
        if (starts[b] < 0 || starts[b] > lengths[b]) return -2;
    // 0: no QK-norm, 1: per head before RoPE, 2: per head after it, 3: across the projection before it
    const int norm_at = norm_mode & 3;
    if ((norm_mode & ~7) || (norm_at && (!norms || !norms[0] || !norms[1] || !(norm_eps > 0.f)))) return -2;
    if (slot_pos && !rows_have_room(lengths, B, capacity)) return -2;
    constexpr bool wide = std::is_same_v<T, float>;
    const int64_t G = H / Hkv, width = (H + 2 * Hkv) * D, half = rotary_dim / 2;
    float* qkv = alloc(B * width);
    float* heads = alloc(B * H * D);
    float* xf = wide ? nullptr : alloc(B * E);  // x widened (half precision only)
    float* yf = wide ? nullptr : alloc(B * E);  // y before rounding (half precision only)
    // x and the heads de-interleaved once per step for the bf16 GEMV (null: it reads them as they are)
    float* xs = splits_x<T>(E) ? alloc(B * E) : nullptr;
    float* hs = splits_x<T>(H * D) ? alloc(B * H * D) : nullptr;
    // Row b attends to slots [first(b), lengths[b]]: from its start (left padding before it).
    const auto first = [&](int64_t b) { return starts ? starts[b] : int64_t(0); };
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) longest = std::max(longest, lengths[b] + 1 - first(b));
    const int64_t heads_b = B * Hkv;
    const int64_t splits = key_splits(heads_b, longest);
    const int64_t per = (longest + splits - 1) / splits, items = heads_b * splits, rows = G;
    float* part = splits > 1 ? alloc(items * rows * (D + 2)) : nullptr;
    const auto release = [&] { for (float* p : {qkv, heads, part, xf, yf, xs, hs}) std::free(p); };
    if (!qkv || !heads || (splits > 1 && !part) || (!wide && (!xf || !yf)) || (splits_x<T>(E) && !xs) ||
        (splits_x<T>(H * D) && !hs)) {
        release();
        return -1;
    }
    const float* xw;
    float* yw;
    if constexpr (wide) {
        xw = x;
        yw = y;
    } else {
        for (int64_t i = 0; i < B * E; ++i) xf[i] = to_f32(x[i]);
        xw = xf;
        yw = yf;
    }
#if MH_VECTOR_FLOATS == 8 && defined(__AVX2__)
    if (xs) split_even_odd(xw, B, E, xs);
#endif
    // One attention problem per row: its own key count.
    Problem Ps[MAX_STEP_ROWS];
    for (int64_t b = 0; b < B; ++b) {
        Problem& P = Ps[b];
        P = Problem{};
        P.q = qkv; P.out = heads; P.mask = nullptr;
        P.k = reinterpret_cast<const float*>(cache_k); P.v = reinterpret_cast<const float*>(cache_v);  // T data
        P.B = B; P.H = H; P.Hkv = Hkv; P.Sq = 1; P.Sk = lengths[b] + 1; P.D = D; P.Dv = D;
        P.qs[0] = width; P.qs[1] = D; P.qs[2] = width;
        for (int i = 0; i < 3; ++i) P.ks[i] = P.vs[i] = cache_strides[i];
        P.os[0] = H * D; P.os[1] = D; P.os[2] = H * D;
        P.scale = scale * 1.4426950408889634f;
        P.causal = true;
        P.window = window;  // 0: none; else the span() of a sliding window
    }
    int failed = 0;
    const TimedThreads timed(step_choices, threads, (width + H * D) * E * static_cast<int64_t>(sizeof(T)));
    std::atomic<int64_t> next_qkv{0}, next_o{0};
#pragma omp parallel num_threads(timed.threads())
    {
        const FlushToZero ftz;  // this thread, for the step (restored as it ends)
        // Every buffer first: nothing is written to the cache unless the whole step can run.
        Buffers buf{alloc(rows * D), alloc(wide_floats(D, D)), alloc(rows * score_stride(KD)), alloc(rows),
                    alloc(rows), alloc(rows * D)};
        if (!buf.ok()) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            {
                const T* Wqkv[3] = {W[0], W[1], W[2]};
                const T* bqkv[3] = {bias[0], bias[1], bias[2]};
                const int64_t N[3] = {H * D, Hkv * D, Hkv * D}, ld[3] = {width, width, width};
                float* out[3] = {qkv, qkv + H * D, qkv + (H + Hkv) * D};
                gemv_chunks(next_qkv, chunk_rows<T>(E), B, xw, xs, E, 3, Wqkv, N, bqkv, out, ld);
            }
#pragma omp barrier
            if (norm_at == 3) {  // q (H·D) and k (Hkv·D) of each row normed across the projection (OLMo 2, 3)
#pragma omp for schedule(static)
                for (int64_t t = 0; t < 2 * B; ++t) {
                    const int64_t b = t / 2, part = t % 2;
                    rms_norm(qkv + b * width + part * H * D, (part ? Hkv : H) * D, norms[part], norm_eps,
                             norm_mode & 4);
                }
            }
#pragma omp for schedule(static)
            for (int64_t t = 0; t < B * (H + Hkv); ++t) {  // rotate q and k heads, store k and v
                const int64_t b = t / (H + Hkv), head = t % (H + Hkv), slot = lengths[b], pos = slot - first(b);
                float* vec = qkv + b * width + head * D;
                const T* norm_w = norm_at == 1 || norm_at == 2 ? norms[head < H ? 0 : 1] : nullptr;
                if (norm_at == 1) rms_norm(vec, D, norm_w, norm_eps, norm_mode & 4);
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
                if (norm_at == 2) rms_norm(vec, D, norm_w, norm_eps, norm_mode & 4);
                if (head >= H) {
                    const int64_t kvh = head - H;
                    const int64_t at = b * cache_strides[0] + kvh * cache_strides[1] + slot * cache_strides[2];
                    const float* vv = qkv + b * width + (H + Hkv + kvh) * D;
                    if (saved) {  // the slot's old K and V, for the caller to restore on a later failure
                        std::memcpy(saved + (b * 2 * Hkv + kvh) * D, cache_k + at, sizeof(T) * D);
                        std::memcpy(saved + ((b * 2 + 1) * Hkv + kvh) * D, cache_v + at, sizeof(T) * D);
                    }
                    for (int64_t i = 0; i < D; ++i) {
                        cache_k[at + i] = from_f32<T>(vec[i]);
                        cache_v[at + i] = from_f32<T>(vv[i]);
                    }
                }
            }
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items; ++it) {
                const int64_t sp = it % splits, head = it / splits, b = head / Hkv, k0 = first(b) + sp * per;
                decode_item<float, T>(Ps[b], buf, b, head % Hkv, k0, std::min(Ps[b].Sk, k0 + per),
                                      part ? part + it * rows * (D + 2) : nullptr);
            }
            if (part) {
#pragma omp for schedule(static)
                for (int64_t head = 0; head < heads_b; ++head)
                    merge_splits<float>(Ps[head / Hkv], part + head * splits * rows * (D + 2), splits, head / Hkv,
                                        head % Hkv);
            }
#if MH_VECTOR_FLOATS == 8 && defined(__AVX2__)
            if (hs) {
#pragma omp single
                split_even_odd(heads, B, H * D, hs);  // (then every thread waits: the implicit barrier)
            }
#endif
            const T* Wo[1] = {W[3]};
            const T* bo[1] = {bias[3]};
            const int64_t N[1] = {E}, ld[1] = {E};
            float* out[1] = {yw};
            gemv_chunks(next_o, chunk_rows<T>(H * D), B, heads, hs, H * D, 1, Wo, N, bo, out, ld);
        }
        buf.release();
    }
    if constexpr (!wide)
        if (!failed)
            for (int64_t i = 0; i < B * E; ++i) y[i] = from_f32<T>(yf[i]);
    release();
    if (failed) return -1;
    timed.done();
    // Given slot_pos, the cache's counters too, as mh_advance_counters (the eager fused step's
    // plan; KVCache.commit otherwise): once everything else is written, so a failure leaves them.
    if (slot_pos) advance(lengths, slot_pos, B, slot_ld);
    return 0;
}

}  // namespace

extern "C" int mh_decode_step_f32(
    const float* x, int64_t B, int64_t E, const float* const* W, const float* const* bias, int64_t H,
    int64_t Hkv, int64_t D, const float* rope_cos, const float* rope_sin, int64_t rotary_dim, int interleaved,
    const float* const* norms, float norm_eps, int norm_mode, float* cache_k, float* cache_v,
    const int64_t* cache_strides, int64_t* lengths, float scale, int64_t window, const int64_t* starts, float* y,
    float* saved, int threads,
    int64_t* slot_pos, int64_t slot_ld, int64_t capacity) {
    return decode_step<float>(x, B, E, W, bias, H, Hkv, D, rope_cos, rope_sin, rotary_dim, interleaved, norms,
                              norm_eps, norm_mode, cache_k, cache_v, cache_strides, lengths, scale, window, starts, y, saved,
                              threads, slot_pos, slot_ld, capacity);
}

// As mh_decode_step_f32 with x, weights, biases, cache and y bfloat16 (uint16 bits); RoPE float32.
extern "C" int mh_decode_step_bf16(
    const void* x, int64_t B, int64_t E, const void* const* W, const void* const* bias, int64_t H,
    int64_t Hkv, int64_t D, const float* rope_cos, const float* rope_sin, int64_t rotary_dim, int interleaved,
    const void* const* norms, float norm_eps, int norm_mode, void* cache_k, void* cache_v,
    const int64_t* cache_strides, int64_t* lengths, float scale, int64_t window, const int64_t* starts, void* y,
    void* saved, int threads,
    int64_t* slot_pos, int64_t slot_ld, int64_t capacity) {
    return decode_step<bf16>(static_cast<const bf16*>(x), B, E, reinterpret_cast<const bf16* const*>(W),
                             reinterpret_cast<const bf16* const*>(bias), H, Hkv, D, rope_cos, rope_sin, rotary_dim,
                             interleaved, reinterpret_cast<const bf16* const*>(norms), norm_eps, norm_mode,
                             static_cast<bf16*>(cache_k), static_cast<bf16*>(cache_v), cache_strides,
                             lengths, scale, window, starts, static_cast<bf16*>(y), static_cast<bf16*>(saved), threads,
                             slot_pos, slot_ld, capacity);
}

// As mh_decode_step_f32 with x, weights, biases, cache and y float16 (uint16 bits); RoPE float32.
extern "C" int mh_decode_step_f16(
    const void* x, int64_t B, int64_t E, const void* const* W, const void* const* bias, int64_t H,
    int64_t Hkv, int64_t D, const float* rope_cos, const float* rope_sin, int64_t rotary_dim, int interleaved,
    const void* const* norms, float norm_eps, int norm_mode, void* cache_k, void* cache_v,
    const int64_t* cache_strides, int64_t* lengths, float scale, int64_t window, const int64_t* starts, void* y,
    void* saved, int threads,
    int64_t* slot_pos, int64_t slot_ld, int64_t capacity) {
    return decode_step<f16>(static_cast<const f16*>(x), B, E, reinterpret_cast<const f16* const*>(W),
                            reinterpret_cast<const f16* const*>(bias), H, Hkv, D, rope_cos, rope_sin, rotary_dim,
                            interleaved, reinterpret_cast<const f16* const*>(norms), norm_eps, norm_mode,
                            static_cast<f16*>(cache_k), static_cast<f16*>(cache_v), cache_strides,
                            lengths, scale, window, starts, static_cast<f16*>(y), static_cast<f16*>(saved), threads, slot_pos,
                            slot_ld, capacity);
}
