// Shared by the native kernels (attention.cpp, decode.cpp, backward.cpp): vector helpers,
// the base-2 exponential, the p·v tiles, the problem description and the per-row online
// softmax.
//
// Notation: B batch, H query heads, Hkv key/value heads, G = H / Hkv query heads per
// K/V head, Sq queries, Sk keys, D head dim, Dv value head dim. Query i sits at key
// position i + (Sk - Sq) (bottom-right alignment, as everywhere in multihead).
//
// The vectors are GCC vector extensions of W floats, W fixed at compile time
// (-march=native) by the machine's widest vector registers:
//   * AVX-512 (32 zmm registers): W = 16, q·kᵀ tiles of 12 rows × 32 keys (24
//     accumulators), p·v tiles of 6 rows × 64 columns (24 accumulators);
//   * otherwise (AVX2: 16 ymm registers): W = 8, q·kᵀ tiles of 6 rows × 16 keys (12
//     accumulators, as BLIS's Haswell kernel), p·v tiles of 6 rows × 16 columns.
// Every tile keeps its accumulators, its loaded vectors and one broadcast in registers.

#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <cmath>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#elif defined(__SSE__)
#include <xmmintrin.h>
#endif

#if defined(__AVX512F__)
#define MH_VECTOR_FLOATS 16
#else
#define MH_VECTOR_FLOATS 8
#endif

namespace mh {

constexpr int W = MH_VECTOR_FLOATS;  // floats per vector
typedef float vf __attribute__((vector_size(4 * MH_VECTOR_FLOATS)));
typedef float vfu __attribute__((vector_size(4 * MH_VECTOR_FLOATS), aligned(4)));  // unaligned access
typedef int32_t vi __attribute__((vector_size(4 * MH_VECTOR_FLOATS)));

#if MH_VECTOR_FLOATS == 16
constexpr int MR = 12;       // query rows of a q·kᵀ tile (12 × 2 = 24 accumulators)
constexpr int PV_NV = 4;     // vectors of columns of a p·v tile (6 × 4 = 24 accumulators)
#else
constexpr int MR = 6;        // query rows of a q·kᵀ tile (6 × 2 = 12 accumulators)
constexpr int PV_NV = 2;     // vectors of columns of a p·v tile (6 × 2 = 12 accumulators)
#endif
constexpr int64_t NR = 2 * W;  // keys per panel: two vectors
constexpr int MR_PV = 6;     // query rows of a p·v tile
constexpr int64_t KC = 512;  // keys per chunk (a packed chunk of D = 64 is 128 KiB, L2)
constexpr int64_t KD = 2048;  // keys per chunk of the decoding loop (one long K stream, then V)
constexpr float NEG_INF = -__builtin_inff();
constexpr int64_t MAX_STEP_ROWS = 8;  // most rows of x for the few-row GEMV and the decoding step

inline vf load(const float* p) { return *(const vfu*)p; }
inline void store(float* p, vf x) { *(vfu*)p = x; }

// ---------------------------------------------------------------------------------------
// Half precision storage (bfloat16, float16): the kernels read and write these types and
// compute in float32 (accumulation, softmax). A value is widened where it is loaded (K
// while packed, V in the p·v tiles, weights in the few-row GEMV) and rounded to nearest
// even where it is stored: no float32 copy of a tensor is ever made.
//   bf16 -> float: the 16 bits shifted left by 16 (exact);   float -> bf16: round to nearest even.
//   f16 <-> float: F16C's vcvtph2ps (exact) where the build has it, else the scalar
//   conversions below (M. Maratyszcza's FP16 method: exact widening, round to nearest even).
struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };

inline float float_of_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t bits_of_float(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return float_of_bits(uint32_t(x.bits) << 16); }
inline float to_f32(f16 x) {
    const uint32_t w = uint32_t(x.bits) << 16, sign = w & 0x80000000u, two_w = w + w;
    // Normal, inf and NaN: exponent rebiased by a multiplication; subnormal: by a subtraction.
    const float normal = float_of_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormal = float_of_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    return float_of_bits(sign | (two_w < (1u << 27) ? bits_of_float(denormal) : bits_of_float(normal)));
}

template <class T> T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline bf16 from_f32<bf16>(float x) {
    const uint32_t u = bits_of_float(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16{uint16_t((u >> 16) | 0x40)};  // NaN stays a (quiet) NaN
    return bf16{uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};  // ties to even; overflow rounds to inf
}
template <> inline f16 from_f32<f16>(float x) {
    const uint32_t w = bits_of_float(x), shl1 = w + w, sign = w & 0x80000000u;
    // The float addition rounds the mantissa to 10 bits (nearest even), subnormals included.
    float base = (std::fabs(x) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t bias = shl1 & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = float_of_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = bits_of_float(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return f16{uint16_t((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign))};
}

// W consecutive values at p, widened to float32.
inline vf load_f(const float* p) { return load(p); }
inline vf load_f(const bf16* p) {
#if MH_VECTOR_FLOATS == 16
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#elif defined(__AVX2__)
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
#else
    vf r;
    for (int i = 0; i < W; ++i) r[i] = to_f32(p[i]);
    return r;
#endif
}
inline vf load_f(const f16* p) {
#if MH_VECTOR_FLOATS == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
    vf r;
    for (int i = 0; i < W; ++i) r[i] = to_f32(p[i]);
    return r;
#endif
}

// Flush-to-zero for the calling thread while it lives (x86: MXCSR's FTZ bit; restored after):
// results below float32's smallest normal (2^-126) become 0 instead of subnormal numbers, whose
// arithmetic takes microcode assists on Intel CPUs. The online softmax makes them: a row's
// first keys may get probabilities near 2^-126 (ALiBi's distant keys, peaked attention), and
// o, accumulated from 0, then stays subnormal through every later multiply-add (ALiBi at
// S=1024: p·v 45% of the forward's time against 18% for q·kᵀ, perf, Intel Xeon). What is
// flushed is below 2^-126 in absolute terms, against a row whose largest probability is 1.
struct FlushToZero {
#if defined(__SSE__)
    unsigned saved = _mm_getcsr();
    FlushToZero() { _mm_setcsr(saved | 0x8000u); }
    ~FlushToZero() { _mm_setcsr(saved); }
    FlushToZero(const FlushToZero&) = delete;
    FlushToZero& operator=(const FlushToZero&) = delete;
#endif
};
// ---------------------------------------------------------------------------------------
// A broadcast (from memory: a load, no arithmetic; `(vf){} + x` would cost an add and a
// shuffle on the FMA ports, and turn -0 into +0: tanhv's sign mask was then 0 with AVX-512).
#if MH_VECTOR_FLOATS == 16
inline vf splat(float x) { return (vf)_mm512_set1_ps(x); }
#elif defined(__AVX__)
inline vf splat(float x) { return (vf)_mm256_set1_ps(x); }
#else
inline vf splat(float x) {
    vf r;
    for (int i = 0; i < W; ++i) r[i] = x;
    return r;
}
#endif
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

inline float hmax(vf x) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)x);
#else
    float m = x[0];
    for (int i = 1; i < W; ++i) m = std::max(m, x[i]);
    return m;
#endif
}

inline float hsum(vf x) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)x);
#elif defined(__AVX__)
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)x), _mm256_extractf128_ps((__m256)x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
    float s = 0.f;
    for (int i = 0; i < W; ++i) s += x[i];
    return s;
#endif
}

// W vectors -> one whose lane p is the sum of x[p]'s lanes, with shuffles and adds
// instead of W horizontal sums.
inline vf reduce_w(const vf* x) {
#if defined(__AVX512F__)
    // Four levels of shuffles and adds (15 adds) and one permutation.
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
    return (vf)_mm512_permutexvar_ps(order, r);
#elif defined(__AVX__)
    // Pairwise horizontal adds within 128-bit halves (6), then the halves added (1).
    const __m256 t0 = _mm256_hadd_ps((__m256)x[0], (__m256)x[1]), t1 = _mm256_hadd_ps((__m256)x[2], (__m256)x[3]);
    const __m256 t2 = _mm256_hadd_ps((__m256)x[4], (__m256)x[5]), t3 = _mm256_hadd_ps((__m256)x[6], (__m256)x[7]);
    // u0: lanes (x0, x1, x2, x3) of the low halves, then of the high halves; u1: x4..x7.
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return (vf)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    vf r;
    for (int p = 0; p < W; ++p) r[p] = hsum(x[p]);
    return r;
#endif
}

// Products per partial sum of qk_tile: the registers sum QK_BLOCK of them from zero, the
// blocks are added up in c. One running sum of d products makes rounding errors of the size
// of its partial sums, about √(d/3)·|s|·u where q and k are aligned: a peaked row's largest
// logit, whose error the exponential turns into the relative error of its probability. At
// D = 96 (GQA 6/2, Sq = Sk = 1024, an asymmetric window) that made the forward's error 3.9×
// the naive float32 one (flash-attention's criterion: 2×) and the backward's dq 3.4× (3×).
// Blocks of 64 bound the partial sums (with the scale applied after the product, below, that
// case is 1.3-1.5× the naive error). Each block costs one load, add and store of the tile:
// measured on AVX2 (Zen 3, 2 threads, H=12, D=64, S=1024/2048, paired against SDPA in one
// process), blocks of 16 made the float32 forward 8-10% slower, 32 about 5%, 64 nothing (one
// block at D ≤ 64, the common head width; two at D = 96 or 128).
constexpr int64_t QK_BLOCK = 64;
// The backward's tiles (scores and dP, whose errors its gradients carry: dq of the strided
// cases, D = 64, measured 3.5× the naive error with blocks of 64) sum blocks of 16; its time is
// mostly the dQ/dK/dV products, not these tiles.
constexpr int64_t QK_BLOCK_BACKWARD = 16;

// c (MR × NR, row stride ldc) = scale · a (MR × d, row stride lda) · panel (d × NR), NR = 2·W:
// the q·kᵀ tile of the forward and the backward (scores, dP), summed in blocks of QK_BLOCK; the
// scale multiplies the sums as they are stored (one rounding per score, as (q·k)·scale: a
// scale folded into a rounds every element of a: the case above, seed 3, 2.0× the naive error
// with blocks alone, 1.3× with the scale here).
inline void qk_tile(const float* __restrict a, int64_t lda, int64_t d, const float* __restrict panel,
                    float* __restrict c, int64_t ldc, float scale = 1.f, int64_t block = QK_BLOCK) {
    for (int64_t t0 = 0; t0 < d; t0 += block) {
        const int64_t t1 = std::min(d, t0 + block);
        vf c0[MR], c1[MR];
#pragma GCC unroll 12
        for (int i = 0; i < MR; ++i) c0[i] = c1[i] = (vf){};
#pragma GCC unroll 4  // with the p·v loop's: the float32 forward 1.013-1.015× (AVX2, paired builds)
        for (int64_t t = t0; t < t1; ++t) {
            const vf b0 = load(panel + t * NR), b1 = load(panel + t * NR + W);
#pragma GCC unroll 12
            for (int i = 0; i < MR; ++i) {
                const vf ai = splat(a[i * lda + t]);
                c0[i] += ai * b0;
                c1[i] += ai * b1;
            }
        }
        if (t0 > 0) {
#pragma GCC unroll 12
            for (int i = 0; i < MR; ++i) {
                c0[i] += load(c + i * ldc);
                c1[i] += load(c + i * ldc + W);
            }
        }
        if (t1 == d && scale != 1.f) {
#pragma GCC unroll 12
            for (int i = 0; i < MR; ++i) {
                c0[i] *= scale;
                c1[i] *= scale;
            }
        }
#pragma GCC unroll 12
        for (int i = 0; i < MR; ++i) {
            store(c + i * ldc, c0[i]);
            store(c + i * ldc + W, c1[i]);
        }
    }
}

#if MH_VECTOR_FLOATS == 8 && defined(__AVX__)
// dst[t·ld + c] = rows[c][t] for t, c < 8: an 8 × 8 transpose in registers.
inline void transpose8(const float* const* rows, float* dst, int64_t ld = NR) {
    __m256 r[8], u[8], w[8];
    for (int c = 0; c < 8; ++c) r[c] = _mm256_loadu_ps(rows[c]);
    for (int c = 0; c < 8; c += 2) {
        u[c] = _mm256_unpacklo_ps(r[c], r[c + 1]);
        u[c + 1] = _mm256_unpackhi_ps(r[c], r[c + 1]);
    }
    for (int c = 0; c < 8; c += 4) {
        w[c] = _mm256_shuffle_ps(u[c], u[c + 2], 0x44);
        w[c + 1] = _mm256_shuffle_ps(u[c], u[c + 2], 0xEE);
        w[c + 2] = _mm256_shuffle_ps(u[c + 1], u[c + 3], 0x44);
        w[c + 3] = _mm256_shuffle_ps(u[c + 1], u[c + 3], 0xEE);
    }
    for (int t = 0; t < 4; ++t) {
        _mm256_storeu_ps(dst + t * ld, _mm256_permute2f128_ps(w[t], w[t + 4], 0x20));
        _mm256_storeu_ps(dst + (t + 4) * ld, _mm256_permute2f128_ps(w[t], w[t + 4], 0x31));
    }
}
#endif

#if MH_VECTOR_FLOATS == 16
// dst[t·ld + c] = rows[c][t] for t, c < 16: a 16 × 16 transpose in registers (pairs of rows
// interleaved, then groups of four within 128-bit lanes, then the lanes themselves). Bitwise:
// the AMX kernel moves pairs of bfloat16 through it as 32-bit lanes.
inline void transpose16(const float* const* rows, float* dst, int64_t ld = NR) {
    __m512 r[16], u[16];
    for (int c = 0; c < 16; ++c) r[c] = _mm512_loadu_ps(rows[c]);
    for (int c = 0; c < 16; c += 2) {  // per lane: rows c, c + 1 at columns 0, 1 / 2, 3
        u[c] = _mm512_unpacklo_ps(r[c], r[c + 1]);
        u[c + 1] = _mm512_unpackhi_ps(r[c], r[c + 1]);
    }
    for (int c = 0; c < 16; c += 4) {  // r[c + i], lane L: rows c..c+3 at column 4L + i
        r[c] = _mm512_shuffle_ps(u[c], u[c + 2], 0x44);
        r[c + 1] = _mm512_shuffle_ps(u[c], u[c + 2], 0xEE);
        r[c + 2] = _mm512_shuffle_ps(u[c + 1], u[c + 3], 0x44);
        r[c + 3] = _mm512_shuffle_ps(u[c + 1], u[c + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {  // the 4 × 4 lanes of r[i], r[4 + i], r[8 + i], r[12 + i] transposed
        const __m512 a0 = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x44);
        const __m512 a1 = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xEE);
        const __m512 b0 = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x44);
        const __m512 b1 = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xEE);
        _mm512_storeu_ps(dst + i * ld, _mm512_shuffle_f32x4(a0, b0, 0x88));
        _mm512_storeu_ps(dst + (4 + i) * ld, _mm512_shuffle_f32x4(a0, b0, 0xDD));
        _mm512_storeu_ps(dst + (8 + i) * ld, _mm512_shuffle_f32x4(a1, b1, 0x88));
        _mm512_storeu_ps(dst + (12 + i) * ld, _mm512_shuffle_f32x4(a1, b1, 0xDD));
    }
}
#endif

// The W dot products of q (D) with keys k[0..W-1] (row stride ldk), D a multiple of W.
template <class TK>
inline vf dot_w(const float* __restrict q, const TK* __restrict k, int64_t ldk, int64_t d) {
    vf acc[W];
#pragma GCC unroll 16
    for (int s = 0; s < W; ++s) acc[s] = (vf){};
#if MH_VECTOR_FLOATS == 16
    // Key by key, each row read front to back: the order the hardware prefetcher follows.
#pragma GCC unroll 16
    for (int s = 0; s < W; ++s)
        for (int64_t t = 0; t < d; t += W) acc[s] += load(q + t) * load_f(k + s * ldk + t);
#else
    // The W keys side by side: W independent sums per step (one key at a time, each sum
    // would be a chain of d / W dependent additions).
    for (int64_t t = 0; t < d; t += W) {
        const vf qt = load(q + t);
#pragma GCC unroll 8
        for (int s = 0; s < W; ++s) acc[s] += qt * load_f(k + s * ldk + t);
    }
#endif
    return reduce_w(acc);
}

// Σ a[t]·b[t], vectorised along t (b widened from its type).
template <class TB>
inline float dot(const float* __restrict a, const TB* __restrict b, int64_t d) {
    vf acc = (vf){};
    int64_t t = 0;
    for (; t + W <= d; t += W) acc += load(a + t) * load_f(b + t);
    float s = hsum(acc);
    for (; t < d; ++t) s += a[t] * to_f32(b[t]);
    return s;
}

// 2^f for f in [-1/2, 1/2]: exp2v's polynomial, degree 6, fitted to 2^f in relative error
// (equioscillating, 1.9e-9 at most; the degree-7 Taylor series it replaced reached 2.3e-8, with
// one more FMA in the softmax's chain: the float32 forward 1.02× as fast on AVX2). Evaluated
// in float32 (Horner, FMAs) it is within 0.93 ulp of 2^f, 0.26 ulp on average (the Taylor
// series: 0.83 / 0.25).
inline vf exp2_poly(vf f) {
    vf p = splat(1.534581242594868e-4f);
    p = p * f + 1.3399930903688073e-3f;
    p = p * f + 9.618489071726799e-3f;
    p = p * f + 5.550328642129898e-2f;
    p = p * f + 2.4022646248340607e-1f;
    p = p * f + 6.931471824645996e-1f;
    return p * f + 1.f;
}

// 2^x for x <= 0 (scores minus their row maximum); exactly 0 for x <= -127, so -inf
// (masked) gives 0. 2^x = 2^n · 2^f, n = round(x), f in [-1/2, 1/2], 2^f by a
// polynomial (exp2_poly: within an ulp of 2^f). NaN stays NaN.
inline vf exp2v(vf x) {
#if MH_VECTOR_FLOATS == 16
    // The same numbers in fewer operations: a rounding, and a scaling by 2^n masked to 0 at
    // n = -127 (the float32 forward 0.98× the time with AVX-512, paired; bitwise equal).
    const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-127.f), (__m512)x);  // NaN stays (second operand)
    const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf p = exp2_poly((vf)_mm512_sub_ps(xc, n));
    const __mmask16 keep = _mm512_cmp_ps_mask(n, _mm512_set1_ps(-127.f), _CMP_NLE_UQ);  // n = -127: exactly 0
    return (vf)_mm512_maskz_scalef_ps(keep, (__m512)p, n);
#else
#if defined(__AVX__)
    x = (vf)_mm256_max_ps(_mm256_set1_ps(-127.f), (__m256)x);  // NaN stays (second operand)
#else
    x = x < -127.f ? splat(-127.f) : x;
#endif
    // t = n + 1.5·2^23 (the addition rounds), so t's bits are those of 1.5·2^23 plus n: its low
    // 9 bits + 127, shifted into the exponent, are 2^n (n = -127 gives +0), without a conversion.
    const float round = 12582912.f;
    const vf t = x + round;
    const vf p = exp2_poly(x - (t - round));
    const vi bits = ((vi)t + 127) << 23;
    return p * (vf)bits;
#endif
}

// o (rows × W·NV, row stride ldo) += p (rows × n, row stride ldp) · v (n × W·NV, row stride ldv);
// v float32, bfloat16 or float16 (widened as loaded).
template <int ROWS, int NV, class TV>
inline void pv_tile(const float* __restrict p, int64_t ldp, int64_t n, const TV* __restrict v,
                    int64_t ldv, float* __restrict o, int64_t ldo) {
    vf acc[ROWS][NV];
#pragma GCC unroll 6
    for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 8
        for (int t = 0; t < NV; ++t) acc[i][t] = load(o + i * ldo + W * t);
#pragma GCC unroll 4
    for (int64_t j = 0; j < n; ++j) {
        vf vj[NV];
#pragma GCC unroll 8
        for (int t = 0; t < NV; ++t) vj[t] = load_f(v + j * ldv + W * t);
#pragma GCC unroll 6
        for (int i = 0; i < ROWS; ++i) {
            vf pij = splat(p[i * ldp + j]);
#pragma GCC unroll 8
            for (int t = 0; t < NV; ++t) acc[i][t] += pij * vj[t];
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 8
        for (int t = 0; t < NV; ++t) store(o + i * ldo + W * t, acc[i][t]);
}

template <int ROWS, class TV>
inline void pv_cols(const float* p, int64_t ldp, int64_t n, const TV* v, int64_t ldv, float* o, int64_t ldo,
             int64_t dv) {
    int64_t c = 0;
    for (; c + W * PV_NV <= dv; c += W * PV_NV) pv_tile<ROWS, PV_NV>(p, ldp, n, v + c, ldv, o + c, ldo);
    switch ((dv - c) / W) {  // fewer than PV_NV vectors left
        case 3: pv_tile<ROWS, 3>(p, ldp, n, v + c, ldv, o + c, ldo); break;
        case 2: pv_tile<ROWS, 2>(p, ldp, n, v + c, ldv, o + c, ldo); break;
        case 1: pv_tile<ROWS, 1>(p, ldp, n, v + c, ldv, o + c, ldo); break;
        default: break;
    }
    c += (dv - c) / W * W;
    for (int i = 0; i < ROWS; ++i)  // the last dv % W columns, plainly
        for (int64_t j = 0; j < n; ++j)
            for (int64_t t = c; t < dv; ++t) o[i * ldo + t] += p[i * ldp + j] * to_f32(v[j * ldv + t]);
}

// Keys per block of the AVX2 p·v: its tiles are narrower (PV_NV·W = 16 columns) than a
// row of V, so V is walked once per tile; in blocks of PV_KEYS keys the rows stay in L1.
constexpr int64_t PV_KEYS = 64;

template <int ROWS, class TV>
inline void pv_rows(const float* p, int64_t ldp, int64_t n, const TV* v, int64_t ldv, float* o, int64_t ldo,
             int64_t dv) {
    if constexpr (W == 16) {
        pv_cols<ROWS>(p, ldp, n, v, ldv, o, ldo, dv);
    } else {
        for (int64_t j = 0; j < n; j += PV_KEYS)
            pv_cols<ROWS>(p + j, ldp, std::min(PV_KEYS, n - j), v + j * ldv, ldv, o, ldo, dv);
    }
}

// o (rows × dv) += p (rows × n) · v (n × dv), rows <= MR.
template <class TV>
inline void pv(const float* p, int64_t ldp, int64_t rows, int64_t n, const TV* v, int64_t ldv, float* o,
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
    float* lse;  // nullptr or (B, H, Sq) natural log-sum-exp of the scaled, masked scores
    const uint8_t* mask;  // nullptr or bool bytes, True = may attend
    int64_t B, H, Hkv, Sq, Sk, D, Dv;
    int64_t qs[3], ks[3], vs[3], os[3], ms[4], ls[3];  // strides (b, h, s) in elements; mask (b, h, i, j)
    float scale;  // scale · log2(e)
    bool causal;
    int64_t window;  // 0: none
    // Logit features and packed sequences (multihead.logits), set by mh_attention_f32 only;
    // zero (make_problem's) = off, so the other kernels never see them.
    float softcap;  // cap · log2(e): the cap in base-2 units; 0: none
    const float* alibi;  // nullptr or (H,) ALiBi slopes (natural units)
    const float* sinks;  // nullptr or (H,) sink logits (natural units)
    const int64_t* seg;  // nullptr or (B|1, 2, Sk): [start, end) of the packed sequence of each key position
    int64_t seg_bs;  // seg's batch stride (0: one packing shared by the batch)
    int64_t* panels;  // nullptr or a count of the q·kᵀ key panels computed (the tests' evidence)
    // A block mask (multihead.BlockMask), set by the FlashAttention loop only; nullptr = none. One
    // int32 per (batch|1, head|1, query block, key block) at strides ts: EMPTY, FULL, or p >= 0,
    // the index of the tile's (bq, bk) bytes in partial. Never with mask (the caller folds it in).
    const int32_t* tiles;
    int64_t ts[4];
    int64_t bq, bk;
    const uint8_t* partial;
    // An additive bias on the scaled logits (natural units), after soft-capping and ALiBi, set by
    // the FlashAttention loop only: nullptr, or float32 (B, H, Sq, Sk) at strides bs (b, h, i, j).
    const float* bias;
    int64_t bs[4];
};

constexpr int32_t TILE_EMPTY = -1, TILE_FULL = -2;
constexpr int64_t MAX_BLOCK_KEYS = 1024;  // bk at most (a row of zeros this long stands for an empty tile)
// A block mask's arguments into P (the FlashAttention loop's and the backward's entries): false
// when they do not describe one (a dense mask too, no strides, block sizes the loops cannot take).
// partial may be null when no tile is partial.
inline bool set_block_mask(Problem& P, const int32_t* tiles, const int64_t* tile_info, const uint8_t* partial,
                           const uint8_t* mask) {
    if (mask || !tile_info) return false;
    for (int i = 0; i < 4; ++i) P.ts[i] = tile_info[i];
    P.bq = tile_info[4];
    P.bk = tile_info[5];
    if (P.bq <= 0 || P.bk <= 0 || P.bk % NR || P.bk > MAX_BLOCK_KEYS) return false;
    P.tiles = tiles;
    P.partial = partial;
    return true;
}
inline int32_t tile_at(const Problem& P, int64_t b, int64_t h, int64_t qb, int64_t kb) {
    return P.tiles[b * P.ts[0] + h * P.ts[1] + qb * P.ts[2] + kb * P.ts[3]];
}

struct Buffers {
    float *qbuf, *kt, *s, *m, *l, *o;
    bool ok() const { return qbuf && kt && s && m && l && o; }
    void release() {
        for (float* p : {qbuf, kt, s, m, l, o}) std::free(p);
    }
};

inline float* alloc(int64_t n) {
    size_t bytes = (size_t(std::max<int64_t>(n, 16)) * sizeof(float) + 63) / 64 * 64;
    return static_cast<float*>(std::aligned_alloc(64, bytes));
}

// The structural rule, the C++ copy of multihead.masks.Structure.span (its property test
// holds both to the dense mask): keys [lo, hi) of [0, Sk) visible from key position pos.
inline void span(const Problem& P, int64_t pos, int64_t& lo, int64_t& hi) {
    lo = 0;
    hi = P.Sk;
    if (P.causal) hi = std::min(hi, pos + 1);
    if (P.window > 0) {
        lo = std::max<int64_t>(lo, pos - P.window + 1);
        if (!P.causal) hi = std::min(hi, pos + P.window);
    }
    hi = std::max(hi, lo);
}
// The span of key position pos in batch row b, also limited to its own packed sequence
// (P.seg; Sq == Sk there). Both bounds stay non-decreasing in pos, so a hull of rows is
// still the first row's lo and the last row's hi.
inline void span(const Problem& P, int64_t b, int64_t pos, int64_t& lo, int64_t& hi) {
    span(P, pos, lo, hi);
    if (P.seg) {
        const int64_t* s = P.seg + b * P.seg_bs;
        lo = std::max(lo, s[pos]);
        hi = std::max(std::min(hi, s[P.Sk + pos]), lo);
    }
}
// Keys [lo, hi) that query rows [p0, p1) of batch row b may see: the hull of their spans
// (Structure.key_range).
inline void key_range(const Problem& P, int64_t p0, int64_t p1, int64_t& lo, int64_t& hi, int64_t b = 0) {
    const int64_t off = P.Sk - P.Sq;  // query i sits at key position i + off
    int64_t unused;
    span(P, b, p0 + off, lo, unused);
    span(P, b, p1 - 1 + off, unused, hi);
    hi = std::max(hi, lo);
}

// tanh(x), float32 within 2 ulp: x·P(x²) for |x| < 0.625 (a degree-6 Chebyshev fit of
// tanh(x)/x in x², 1.2 ulp), else (1 − t)/(1 + t) with t = e^(−2|x|) = 2^(−2|x|·log2 e)
// (no cancellation: t < 0.29; |x| > 9 gives ±1), signed. NaN stays NaN (a NaN score is
// not capped into a finite one).
inline vf tanhv(vf x) {
    const vi sign = (vi)x & (vi)splat(-0.f);
    const vf a = (vf)((vi)x ^ sign);  // |x|
    const vf a2 = a * a;
    vf p = splat(2.128777793e-03f);
    p = p * a2 - 8.155326359e-03f;
    p = p * a2 + 2.168794163e-02f;
    p = p * a2 - 5.394331366e-02f;
    p = p * a2 + 1.333316118e-01f;
    p = p * a2 - 3.333332837e-01f;
    p = p * a2 * a + a;
    const vf t = exp2v((a > 9.f ? splat(9.f) : a) * -2.8853900817779268f);  // 2^(−2|x|·log2 e); NaN stays
    const vf big = (1.f - t) / (1.f + t);
    return (vf)((vi)(a < 0.625f ? p : big) | sign);
}

// Soft-capping then ALiBi (multihead.logits' order) on the scores si[a, e) of a row at key
// position pos of head h, keys j0 + j, in base-2 units; whole vectors around [a, e) (the
// caller masks what lies outside afterwards).
inline void apply_logits(const Problem& P, float* __restrict si, int64_t a, int64_t e, int64_t j0, int64_t pos,
                         int64_t h) {
    const int64_t v0 = a / W * W, v1 = (e + W - 1) / W * W;
    if (P.softcap > 0.f) {
        const float inv = 1.f / P.softcap;
        for (int64_t j = v0; j < v1; j += W) store(si + j, tanhv(load(si + j) * inv) * P.softcap);
    }
    if (P.alibi) {
        const float slope = P.alibi[h] * 1.4426950408889634f;  // base 2
        vf col;
        for (int i = 0; i < W; ++i) col[i] = float(j0 - pos + i);  // key − position of lane i
        col += float(v0);
        for (int64_t j = v0; j < v1; j += W, col += float(W)) {
            const vf neg = -col;
            store(si + j, load(si + j) - slope * (col > 0.f ? col : neg));  // − slope·|pos − key|
        }
    }
}
// The additive bias (P.bias) on the scores si[a, e) of the query at key position pos (keys j0 + j).
inline void add_bias(const Problem& P, float* __restrict si, int64_t a, int64_t e, int64_t j0, int64_t pos,
                     int64_t b, int64_t h) {
    const float* row = P.bias + b * P.bs[0] + h * P.bs[1] + (pos - (P.Sk - P.Sq)) * P.bs[2];
    constexpr float LOG2E_F = 1.4426950408889634f;  // scores are in base 2
    if (P.bs[3] == 1) {
        const float* r = row + j0;
        for (int64_t j = a; j < e; ++j) si[j] += r[j] * LOG2E_F;
    } else {
        for (int64_t j = a; j < e; ++j) si[j] += row[(j0 + j) * P.bs[3]] * LOG2E_F;
    }
}

// The logit features, then -inf where a query row may not look: its scores si[0, width) (keys
// j0 + j; width a multiple of W; columns from `valid` on are not keys), at key position pos of
// batch row b, head h, mask row mrow (or null).
// mrow[(key - mcol0) · ms[3]] is the byte of key `key` (mcol0: the first key of a block mask's tile).
inline void mask_row(const Problem& P, float* __restrict si, int64_t width, int64_t valid, int64_t j0,
                     int64_t pos, const uint8_t* mrow, int64_t b, int64_t h, int64_t mcol0 = 0) {
    // This query's span (key position pos, batch row b), as column indices into si.
    int64_t a, e;
    span(P, b, pos, a, e);
    a = std::clamp<int64_t>(a - j0, 0, width);
    e = std::clamp<int64_t>(std::min(e - j0, valid), a, width);
    if (P.softcap > 0.f || P.alibi) apply_logits(P, si, a, e, j0, pos, h);  // before masking
    if (P.bias) add_bias(P, si, a, e, j0, pos, b, h);
    for (int64_t j = 0; j < a; ++j) si[j] = NEG_INF;
    for (int64_t j = e; j < width; ++j) si[j] = NEG_INF;
    if (!mrow) return;
    int64_t j = a;
    if (P.ms[3] == 1) {  // contiguous bytes (a key padding mask): W at a time
        const uint8_t* mj = mrow + j0 - mcol0;
        const vf ninf = splat(NEG_INF);
        for (; j + W <= e; j += W) {
            vi keep;
            for (int t = 0; t < W; ++t) keep[t] = mj[j + t];
            store(si + j, keep != 0 ? load(si + j) : ninf);
        }
    }
    for (; j < e; ++j)
        if (!mrow[(j0 + j - mcol0) * P.ms[3]]) si[j] = NEG_INF;
}

// The largest of si[0, width), width a multiple of W, with four running maxima: one chain of
// dependent vmax (4 cycles each) took 15% of row_update with AVX-512 (perf, the float32 forward).
inline float row_max(const float* __restrict si, int64_t width) {
    vf mx = splat(NEG_INF), m1 = mx, m2 = mx, m3 = mx;
    int64_t j = 0;
    for (; j + 4 * W <= width; j += 4 * W) {
        mx = vmax(mx, load(si + j));
        m1 = vmax(m1, load(si + j + W));
        m2 = vmax(m2, load(si + j + 2 * W));
        m3 = vmax(m3, load(si + j + 3 * W));
    }
    for (; j < width; j += W) mx = vmax(mx, load(si + j));
    return hmax(vmax(vmax(mx, m1), vmax(m2, m3)));
}

// One query row of a chunk: mask its scores si[0, width) (mask_row), then the online softmax
// (base 2): m' = max(m, max si), o *= 2^(m - m'), l = l·2^(m - m') + Σ 2^(si - m'),
// leaving the probabilities 2^(si - m') in si for p · v.
inline void row_update(const Problem& P, float* __restrict si, int64_t width, int64_t valid, int64_t j0,
                       int64_t pos, const uint8_t* mrow, float& m, float& l, float* __restrict orow,
                       int64_t b = 0, int64_t h = 0, int64_t mcol0 = 0) {
    mask_row(P, si, width, valid, j0, pos, mrow, b, h, mcol0);
    const float m_new = std::max(m, row_max(si, width));
    // No allowed key yet: keep probabilities 0 (2^-inf) without NaN.
    const float m_use = m_new == NEG_INF ? 0.f : m_new;
    const float alpha = exp2v(splat(m - m_use))[0];
    vf sum = (vf){}, sum1 = (vf){};
    const vf mv = splat(m_use);
    int64_t j = 0;
    for (; j + 2 * W <= width; j += 2 * W) {  // two independent chains of exp2v's latency
        const vf p0 = exp2v(load(si + j) - mv), p1 = exp2v(load(si + j + W) - mv);
        store(si + j, p0);
        store(si + j + W, p1);
        sum += p0;
        sum1 += p1;
    }
    for (; j < width; j += W) {
        const vf pj = exp2v(load(si + j) - mv);
        store(si + j, pj);
        sum += pj;
    }
    sum += sum1;
    const bool first = m == NEG_INF;  // no allowed key before: o is still all zeros
    m = m_new;
    l = l * alpha + hsum(sum);
    if (alpha != 1.f && !first)
        for (int64_t t = 0; t < P.Dv; ++t) orow[t] *= alpha;
}

// strides: q, k, v, out (b, h, s), mask (b, h, i, j), lse (b, h, s): 19 int64.
inline Problem make_problem(const float* q, const float* k, const float* v, float* out, float* lse,
                            const uint8_t* mask, const int64_t* dims, const int64_t* strides, float scale,
                            int causal, int64_t window) {
    Problem P{};
    P.q = q; P.k = k; P.v = v; P.out = out; P.lse = lse; P.mask = mask;
    P.B = dims[0]; P.H = dims[1]; P.Hkv = dims[2]; P.Sq = dims[3]; P.Sk = dims[4]; P.D = dims[5]; P.Dv = dims[6];
    for (int i = 0; i < 3; ++i) {
        P.qs[i] = strides[i]; P.ks[i] = strides[3 + i]; P.vs[i] = strides[6 + i]; P.os[i] = strides[9 + i];
    }
    for (int i = 0; i < 4; ++i) P.ms[i] = strides[12 + i];
    for (int i = 0; i < 3; ++i) P.ls[i] = strides[16 + i];
    P.scale = scale * 1.4426950408889634f;  // scores in base 2: 2^(s·log2 e) = e^s
    P.causal = causal != 0;
    P.window = window;
    return P;
}

// What a row's o is multiplied by: 1 / l, or with a sink (P.sinks) 1 / (l + 2^(sink − m))
// (the sink joins the denominator, contributes no value), computed against max(m, sink)
// so that no exponential overflows; 0 for a row with no visible key, sink or not.
inline float row_scale(const Problem& P, int64_t h, float m, float l) {
    if (!(l > 0.f)) return 0.f;
    if (!P.sinks) return 1.f / l;
    const float sink = P.sinks[h] * 1.4426950408889634f, top = std::max(m, sink);
    const float keys = std::exp2(m - top);
    return keys / (l * keys + std::exp2(sink - top));
}

// Whether the FlashAttention loops give each thread whole (b, K/V head) pairs (heads of them),
// packing a pair's K (and V) once, rather than sharing out (pair, query tile) items: where the
// pairs split evenly over the threads, or are many enough that an uneven split costs little.
inline bool whole_pairs(int64_t heads, int threads) { return heads % threads == 0 || heads >= 4 * threads; }

// The bfloat16 FlashAttention loop on AMX tiles (attention_amx.cpp): whether it runs P here (a
// build with AMX, the operating system's permission to use it, not switched off, some key), and
// the loop itself (every feature of mh_attention_bf16, its return codes).
bool amx_takes(const Problem& P);
int attention_amx(const Problem& P, int64_t query_tile, int threads);

// The float32 FlashAttention loop's problems of few keys, run with the rows in the vector lanes
// (decode.cpp's small_item, packed sequences too): whether it takes P (AVX-512, at most 128
// keys, at least W/2 rows per K/V head, no logit feature, bias, block mask or panel count), and
// the loop itself (mh_attention_f32's return codes).
bool lanes_take(const Problem& P);
int lanes_attention(const Problem& P, int threads);

// The natural log-sum-exp of a row from its base-2 running max m and sum l; -inf for none.
inline float row_lse(float m, float l) {
    return l > 0.f ? (m + std::log2(l)) * 0.6931471805599453f : NEG_INF;
}
inline void store_lse(const Problem& P, int64_t b, int64_t h, int64_t i, float m, float l) {
    if (P.lse) P.lse[b * P.ls[0] + h * P.ls[1] + i * P.ls[2]] = row_lse(m, l);
}
inline bool valid(const Problem& P) {
    return P.B >= 0 && P.Sq >= 0 && P.Sk >= 0 && P.Hkv > 0 && P.H > 0 && P.H % P.Hkv == 0 && P.D > 0 && P.Dv > 0;
}

}  // namespace mh
