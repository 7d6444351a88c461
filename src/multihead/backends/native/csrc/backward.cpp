// multihead's native attention backward (FlashAttention-2's), and a float64 forward
// for checking it.
//
// Notation: B batch, H query heads, Hkv key/value heads, G = H / Hkv query heads per
// K/V head, Sq queries, Sk keys, D head dim, Dv value head dim. Query i sits at key
// position i + (Sk - Sq) (bottom-right alignment), its keys given by mh::span, the C++
// copy of the structural rule (common.h).
//
// The forward saved only the per-row log-sum-exp (lse, natural log) and its output;
// the caller passes delta_i = Σ_t dO[i, t] · O[i, t] − dlse_i (O(S) numbers). For
// every visible (i, j) the probability is recomputed and the gradients follow:
//
//   p_ij  = exp(scale · q_i·k_j − lse_i)          (0 where masked; rows with lse = −inf skipped)
//   dp_ij = dO_i · v_j
//   ds_ij = p_ij · (dp_ij − delta_i)
//   dV_j += p_ij · dO_i        dK_j += scale · ds_ij · q_i        dQ_i += scale · ds_ij · k_j
//
// Two passes, each parallel over independent outputs (no atomics, the same numbers
// for any thread count):
//   1. items (b, query head, tile of QT rows): dQ of the tile, keys in chunks of KC2,
//      and each row's Σ p as recomputed (normalising p exactly: see dq_tile);
//   2. items (b, K/V head, block of KB keys): dK and dV of the block, summed over the
//      G query heads of the group (K/V are never repeated) and every query row whose
//      span meets the block (causal: the rows above the diagonal are skipped).
// No S×S matrix exists: each thread holds one block's accumulators and one row's scores.
//
// That plain code is templated on the scalar; it runs float64 (so that
// torch.autograd.gradcheck checks the algorithm in float64). float32 runs the same
// gradients with register tiles (backward_f32, below), in one of two ways chosen by the
// shapes alone (never the thread count, so the results are the same for any):
//   * fused, from FUSED_MIN_ITEMS (b, K/V head) pairs: one item per pair walks its key
//     blocks in order, each block's dK, dV and its share of dQ (summed in place): five
//     products per score (FlashAttention-2's), probabilities not renormalised;
//   * otherwise the two passes above (seven products per score, parallel over tiles).
// Returns 0, or -1 out of memory, -2 bad shape.

#include <limits>
#include <type_traits>

#include "common.h"
#include "kernels.h"

namespace {

using namespace mh;

constexpr int64_t KB = 64;    // keys per dK/dV block (pass 1)
constexpr int64_t QT = 16;    // query rows per dQ tile (pass 2)
constexpr int64_t KC2 = 256;  // keys per chunk of pass 2 (its K and V stay in L2)

template <typename T>
struct Grad {
    // q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), dout (B, H, Sq, Dv) and the gradients
    // dq, dk, dv (shaped like q, k, v): rows of contiguous elements at any strides (b, h, s) below.
    const T *q, *k, *v, *dout, *lse, *delta;  // lse, delta: contiguous (B, H, Sq)
    const uint8_t* mask;                      // nullptr or bool bytes with strides ms (b, h, i, j)
    T *dq, *dk, *dv;
    T* norm;  // (B, H, Sq): 1 / Σ_j exp(s_ij − lse_i) as recomputed here (pass 2), ≈ 1
    int64_t B, H, Hkv, Sq, Sk, D, Dv, ms[4];
    int64_t qs[3], ks[3], vs[3], dos[3], dqs[3], dks[3], dvs[3];  // strides (b, h, s) in elements
    T scale;
    Problem rule;  // dims, causal, window: what mh::span reads
    // An additive bias on the scaled logits (float32 only): nullptr, or read at strides bs (b, h, i, j),
    // any sign (a relative bias is a vector per head read along a diagonal); dbias: nullptr, or
    // (B, H, Sq, Sk) contiguous, gets ds (the bias' gradient, 0 where masked); drel: nullptr, or the
    // sums of ds along diagonals, [b, h, (block,) j - i + Sq - 1], drel_blocks vectors of Sq + Sk - 1
    // per (b, h), one per key block (the two passes: blocks of one head run on any thread) or one.
    const float* bias;
    int64_t bs[4];
    float* dbias;
    float* drel;
    int64_t drel_blocks;

    const T* qrow(int64_t b, int64_t h, int64_t i) const { return q + b * qs[0] + h * qs[1] + i * qs[2]; }
    const T* krow(int64_t b, int64_t h, int64_t j) const { return k + b * ks[0] + h * ks[1] + j * ks[2]; }
    const T* vrow(int64_t b, int64_t h, int64_t j) const { return v + b * vs[0] + h * vs[1] + j * vs[2]; }
    const T* dorow(int64_t b, int64_t h, int64_t i) const { return dout + b * dos[0] + h * dos[1] + i * dos[2]; }
    T* dqrow(int64_t b, int64_t h, int64_t i) const { return dq + b * dqs[0] + h * dqs[1] + i * dqs[2]; }
    T* dkrow(int64_t b, int64_t h, int64_t j) const { return dk + b * dks[0] + h * dks[1] + j * dks[2]; }
    T* dvrow(int64_t b, int64_t h, int64_t j) const { return dv + b * dvs[0] + h * dvs[1] + j * dvs[2]; }
    int64_t row(int64_t b, int64_t h, int64_t i) const { return (b * H + h) * Sq + i; }
    const uint8_t* mrow(int64_t b, int64_t h, int64_t i) const {
        return mask ? mask + b * ms[0] + h * ms[1] + i * ms[2] : nullptr;
    }
};

template <typename T>
inline T dot_t(const T* __restrict a, const T* __restrict b, int64_t n) {
    T s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t t = 0; t < n; ++t) s += a[t] * b[t];
    return s;
}

template <typename T>
inline void axpy(T a, const T* __restrict x, T* __restrict y, int64_t n) {
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) y[t] += a * x[t];
}

// out[j] = x · rows[j] for j < n (rows of length d, stride ld): dot products.
template <typename T>
inline void dots(const T* __restrict x, const T* __restrict rows, int64_t n, int64_t d, int64_t ld,
                 T* __restrict out) {
    for (int64_t j = 0; j < n; ++j) out[j] = dot_t(x, rows + j * ld, d);
}
// x[j] = exp(x[j] − c) for j < n (x[j] = −inf gives 0).
inline void exp_shift(double* x, int64_t n, double c) {
    for (int64_t j = 0; j < n; ++j) x[j] = std::exp(x[j] - c);
}

// Row i's visible keys within [j0, j1) as [a, e); false when none.
template <typename T>
inline bool visible(const Grad<T>& g, int64_t i, int64_t j0, int64_t j1, int64_t& a, int64_t& e) {
    span(g.rule, i + g.Sk - g.Sq, a, e);
    a = std::max(a, j0);
    e = std::min(e, j1);
    return a < e;
}

// For row i (head h) and keys [a, e): p (into p, times `factor`) and ds (into ds), and
// adds Σ p (before the factor) to *sum; returns false if the row has no key at all
// (lse = −inf: zero gradients).
template <typename T>
inline bool row_grads(const Grad<T>& g, int64_t b, int64_t h, int64_t i, int64_t a, int64_t e, T* p, T* ds,
                      T factor, T* sum) {
    const int64_t r = g.row(b, h, i);
    const T lse = g.lse[r];
    if (!(lse > -std::numeric_limits<T>::infinity())) return false;
    const T* qi = g.qrow(b, h, i);
    const T* doi = g.dorow(b, h, i);
    const int64_t kv = h / (g.H / g.Hkv);
    const uint8_t* m = g.mrow(b, h, i);
    const T neg_inf = -std::numeric_limits<T>::infinity();
    dots(qi, g.krow(b, kv, a), e - a, g.D, g.ks[2], p);
    for (int64_t j = a; j < e; ++j)
        p[j - a] = (m && !m[j * g.ms[3]]) ? neg_inf : g.scale * p[j - a];
    exp_shift(p, e - a, lse);
    T total = 0;
    for (int64_t j = 0; j < e - a; ++j) total += p[j];
    *sum += total;
    if (factor != T(1))
        for (int64_t j = 0; j < e - a; ++j) p[j] *= factor;
    const T delta = g.delta[r];
    dots(doi, g.vrow(b, kv, a), e - a, g.Dv, g.vs[2], ds);  // dp
    for (int64_t j = 0; j < e - a; ++j) ds[j] = p[j] == T(0) ? T(0) : p[j] * (ds[j] - delta);
    return true;
}

// Pass 2: dK, dV of keys [j0, j1) of (b, kvh).
// acc[j] += Σ_r c[r][j] · x_r for j < n, r < R (rows x_r of length d; acc rows of stride d):
// R rows at a time, so each accumulator row is loaded and stored once per R rows.
template <typename T, int R>
inline void rank_update(T* __restrict acc, const T* const* x, const T* c, int64_t ldc, int64_t n, int64_t d) {
    for (int64_t j = 0; j < n; ++j) {
        T cj[R];
        bool any = false;
        for (int r = 0; r < R; ++r) any |= (cj[r] = c[r * ldc + j]) != T(0);
        if (!any) continue;
        T* __restrict aj = acc + j * d;
#pragma omp simd
        for (int64_t t = 0; t < d; ++t) {
            T sum = aj[t];
            for (int r = 0; r < R; ++r) sum += cj[r] * x[r][t];
            aj[t] = sum;
        }
    }
}

// y (d) += Σ_j c[j] · rows[j] (n rows of length d, stride ld).
template <typename T>
inline void combine(T* __restrict y, const T* __restrict c, const T* __restrict rows, int64_t n, int64_t d,
                    int64_t ld) {
    for (int64_t j = 0; j < n; ++j)
        if (c[j] != T(0)) axpy(c[j], rows + j * ld, y, d);
}
constexpr int RB = 4;  // query rows per rank update of pass 2

// Pass 2: dK, dV of keys [j0, j1) of (b, kvh). p and ds hold RB rows of KB columns.
template <typename T>
void dkdv_block(const Grad<T>& g, int64_t b, int64_t kvh, int64_t j0, int64_t j1, T* acc_k, T* acc_v, T* p, T* ds) {
    const int64_t G = g.H / g.Hkv, n = j1 - j0;
    std::fill(acc_k, acc_k + n * g.D, T(0));
    std::fill(acc_v, acc_v + n * g.Dv, T(0));
    const T* qs[RB];
    const T* dos[RB];
    int rows = 0;
    auto flush = [&]() {
        for (int r = rows; r < RB; ++r) {  // unused rows weigh nothing
            std::fill(p + r * KB, p + (r + 1) * KB, T(0));
            std::fill(ds + r * KB, ds + (r + 1) * KB, T(0));
            qs[r] = qs[0];
            dos[r] = dos[0];
        }
        rank_update<T, RB>(acc_v, dos, p, KB, n, g.Dv);
        rank_update<T, RB>(acc_k, qs, ds, KB, n, g.D);
        rows = 0;
    };
    for (int64_t gi = 0; gi < G; ++gi) {
        const int64_t h = kvh * G + gi;
        for (int64_t i = 0; i < g.Sq; ++i) {
            int64_t a, e;
            T unused = 0;
            T *pr = p + rows * KB, *dr = ds + rows * KB;
            if (!visible(g, i, j0, j1, a, e) ||
                !row_grads(g, b, h, i, a, e, pr + (a - j0), dr + (a - j0), g.norm[g.row(b, h, i)], &unused))
                continue;
            std::fill(pr, pr + (a - j0), T(0));
            std::fill(pr + (e - j0), pr + KB, T(0));
            std::fill(dr, dr + (a - j0), T(0));
            std::fill(dr + (e - j0), dr + KB, T(0));
            for (int64_t j = 0; j < n; ++j) dr[j] *= g.scale;
            qs[rows] = g.qrow(b, h, i);
            dos[rows] = g.dorow(b, h, i);
            if (++rows == RB) flush();
        }
    }
    if (rows) flush();
    for (int64_t j = 0; j < n; ++j) {
        std::copy(acc_k + j * g.D, acc_k + (j + 1) * g.D, g.dkrow(b, kvh, j0 + j));
        std::copy(acc_v + j * g.Dv, acc_v + (j + 1) * g.Dv, g.dvrow(b, kvh, j0 + j));
    }
}

// Pass 1: dQ of rows [i0, i1) of (b, h), and their normalisers.
template <typename T>
void dq_tile(const Grad<T>& g, int64_t b, int64_t h, int64_t i0, int64_t i1, T* acc, T* p, T* ds) {
    const int64_t kv = h / (g.H / g.Hkv);
    std::fill(acc, acc + (i1 - i0) * g.D, T(0));
    T* sums = g.norm + g.row(b, h, i0);
    std::fill(sums, sums + (i1 - i0), T(0));
    for (int64_t c0 = 0; c0 < g.Sk; c0 += KC2) {
        const int64_t c1 = std::min(c0 + KC2, g.Sk);
        for (int64_t i = i0; i < i1; ++i) {
            int64_t a, e;
            if (!visible(g, i, c0, c1, a, e) || !row_grads(g, b, h, i, a, e, p, ds, T(1), sums + (i - i0))) continue;
            T* __restrict dqi = acc + (i - i0) * g.D;
            const int64_t n = e - a;
            for (int64_t j = 0; j < n; ++j) ds[j] *= g.scale;
            combine(dqi, ds, g.krow(b, kv, a), n, g.D, g.ks[2]);
        }
    }
    // The stored lse is rounded (float32: up to half an ulp of |lse|, the same relative
    // error for every p of the row); Σ p recomputed here undoes it. ds is linear in p,
    // so dq is rescaled at the end and pass 1 scales its p by the same factor.
    for (int64_t i = 0; i < i1 - i0; ++i) {
        sums[i] = sums[i] > T(0) ? T(1) / sums[i] : T(0);
        for (int64_t t = 0; t < g.D; ++t) acc[i * g.D + t] *= sums[i];
    }
    for (int64_t i = 0; i < i1 - i0; ++i) std::copy(acc + i * g.D, acc + (i + 1) * g.D, g.dqrow(b, h, i0 + i));
}

template <typename T>
T* alloc_t(int64_t n) {
    size_t bytes = (size_t(std::max<int64_t>(n, 16)) * sizeof(T) + 63) / 64 * 64;
    return static_cast<T*>(std::aligned_alloc(64, bytes));
}

template <typename T>
int backward(Grad<T>& g, int threads) {
    if (g.B < 0 || g.Sq < 0 || g.Sk < 0 || g.Hkv <= 0 || g.H <= 0 || g.H % g.Hkv || g.D <= 0 || g.Dv <= 0) return -2;
    g.rule.Sq = g.Sq;
    g.rule.Sk = g.Sk;
    const int64_t key_blocks = (g.Sk + KB - 1) / KB, row_tiles = (g.Sq + QT - 1) / QT;
    const int64_t items1 = g.B * g.Hkv * key_blocks, items2 = g.B * g.H * row_tiles;
    const int64_t width = std::max(KB, KC2);
    g.norm = alloc_t<T>(g.B * g.H * g.Sq);
    if (!g.norm) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        T *acc_k = alloc_t<T>(KB * g.D), *acc_v = alloc_t<T>(KB * g.Dv), *acc_q = alloc_t<T>(QT * g.D);
        T *p = alloc_t<T>(std::max<int64_t>(width, RB * KB)), *ds = alloc_t<T>(std::max<int64_t>(width, RB * KB));
        if (!acc_k || !acc_v || !acc_q || !p || !ds) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items2; ++it) {
                const int64_t tile = row_tiles - 1 - it % row_tiles, rest = it / row_tiles;  // long rows first
                const int64_t i0 = tile * QT;
                dq_tile(g, rest / g.H, rest % g.H, i0, std::min(i0 + QT, g.Sq), acc_q, p, ds);
            }  // (implicit barrier: pass 1 reads every row's norm)
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items1; ++it) {
                const int64_t blk = it % key_blocks, rest = it / key_blocks;
                const int64_t j0 = blk * KB;
                dkdv_block(g, rest / g.Hkv, rest % g.Hkv, j0, std::min(j0 + KB, g.Sk), acc_k, acc_v, p, ds);
            }
        }
        for (T* buf : {acc_k, acc_v, acc_q, p, ds}) std::free(buf);
    }
    std::free(g.norm);
    return failed ? -1 : 0;
}

// ---- float32: the same gradients with register tiles -------------------------------
//
// The products of both passes are small GEMMs in register tiles, as the forward's:
//   s  = q·kᵀ, dp = dO·vᵀ    MR × NR tiles from packed panels (D, NR) of K and (Dv, NR) of V
//   dQ += ds · K             rows × W·NV tiles, ds broadcast, K rows (padded to Dp) loaded
//   dV += pᵀ · dO            the same tiles, p read down its columns (no transpose)
//   dK += dsᵀ · Q
// Queries are packed pre-multiplied by scale·log2(e), so s is in base 2 and p = 2^(s − lse·log2 e)
// (exp2v); dQ then carries the factor scale, dK the factor ln 2. Rows and columns are
// padded with zeros to whole tiles (Dp, Dvp: D, Dv rounded up to W), so the tiles have no
// tails. Every sum runs in an order fixed by the shapes: the results do not depend on
// the thread count.

constexpr int64_t QT1 = 16 * MR;   // query rows per head of a dQ item (pass 1)
constexpr int64_t KC1 = 256;       // keys per chunk of pass 1 (packed twice: panels and rows)
constexpr int64_t KB2 = 96;        // keys per dK/dV item (pass 2): 16 tiles of 6 rows
constexpr int64_t QB2 = 8 * MR;    // query rows per batch of pass 2
constexpr float LOG2E = 1.4426950408889634f;
constexpr int64_t ACC_SPAN = 64;   // terms of a product summed apart before joining the total
static_assert(KC1 % NR == 0 && KB2 % NR == 0 && KB2 % MR_PV == 0, "tiles must divide the blocks");

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }


// c (ROWS × W·NV, row stride ldc) += Σ_{j < n} a[i·ai + j·aj] · b[j] (rows of b: stride ldb), the
// n terms summed apart and then added to c: long sums (dK, dV over G·Sq rows, dQ over Sk keys)
// are sums of partial sums of at most a batch or a chunk, whose rounding error grows far slower.
template <int ROWS, int NV>
inline void acc_tile(const float* __restrict a, int64_t ai, int64_t aj, int64_t n, const float* __restrict b,
                     int64_t ldb, float* __restrict c, int64_t ldc) {
    vf acc[ROWS][NV];
#pragma GCC unroll 6
    for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 4
        for (int t = 0; t < NV; ++t) acc[i][t] = (vf){};
    for (int64_t j = 0; j < n; ++j) {
        vf bj[NV];
#pragma GCC unroll 4
        for (int t = 0; t < NV; ++t) bj[t] = load(b + j * ldb + W * t);
#pragma GCC unroll 6
        for (int i = 0; i < ROWS; ++i) {
            const vf aij = splat(a[i * ai + j * aj]);
#pragma GCC unroll 4
            for (int t = 0; t < NV; ++t) acc[i][t] += aij * bj[t];
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 4
        for (int t = 0; t < NV; ++t) store(c + i * ldc + W * t, load(c + i * ldc + W * t) + acc[i][t]);
}

template <int ROWS>
inline void acc_cols(const float* a, int64_t ai, int64_t aj, int64_t n, const float* b, int64_t ldb, float* c,
                     int64_t ldc, int64_t width) {
    int64_t col = 0;
    for (; col + W * PV_NV <= width; col += W * PV_NV) acc_tile<ROWS, PV_NV>(a, ai, aj, n, b + col, ldb, c + col, ldc);
    switch ((width - col) / W) {  // fewer than PV_NV vectors left (width is a multiple of W)
        case 3: acc_tile<ROWS, 3>(a, ai, aj, n, b + col, ldb, c + col, ldc); break;
        case 2: acc_tile<ROWS, 2>(a, ai, aj, n, b + col, ldb, c + col, ldc); break;
        case 1: acc_tile<ROWS, 1>(a, ai, aj, n, b + col, ldb, c + col, ldc); break;
        default: break;
    }
}

// c (rows × width) += A · b, A[i][j] = a[i·ai + j·aj] (rows × n), b (n × width, stride ldb);
// width a multiple of W; the terms in pieces of at most ACC_SPAN.
inline void acc_gemm(const float* a, int64_t ai, int64_t aj, int64_t rows, int64_t n, const float* b, int64_t ldb,
                     float* c, int64_t ldc, int64_t width) {
    if (n > ACC_SPAN) {  // in pieces, each summed apart
        for (int64_t j = 0; j < n; j += ACC_SPAN)
            acc_gemm(a + j * aj, ai, aj, rows, std::min(ACC_SPAN, n - j), b + j * ldb, ldb, c, ldc, width);
        return;
    }
    for (int64_t r = 0; r < rows; r += MR_PV) {
        const float* ar = a + r * ai;
        float* cr = c + r * ldc;
        switch (std::min<int64_t>(MR_PV, rows - r)) {
            case 6: acc_cols<6>(ar, ai, aj, n, b, ldb, cr, ldc, width); break;
            case 5: acc_cols<5>(ar, ai, aj, n, b, ldb, cr, ldc, width); break;
            case 4: acc_cols<4>(ar, ai, aj, n, b, ldb, cr, ldc, width); break;
            case 3: acc_cols<3>(ar, ai, aj, n, b, ldb, cr, ldc, width); break;
            case 2: acc_cols<2>(ar, ai, aj, n, b, ldb, cr, ldc, width); break;
            default: acc_cols<1>(ar, ai, aj, n, b, ldb, cr, ldc, width); break;
        }
    }
}

// Keys [first, first + npan·NR) of rows src (length d, stride ld) as panels (d, NR): dst[pan][t][j];
// zero from key `limit` on.
inline void pack_panels(const float* src, int64_t d, int64_t ld, int64_t first, int64_t npan, int64_t limit,
                        float* dst) {
    for (int64_t pan = 0; pan < npan; ++pan) {
        float* p = dst + pan * d * NR;
        const int64_t k0 = first + pan * NR;
#if MH_VECTOR_FLOATS == 8 && defined(__AVX__)
        if (d % 8 == 0 && k0 + NR <= limit) {
            for (int64_t j = 0; j < NR; j += 8) {
                const float* rows[8];
                for (int c = 0; c < 8; ++c) rows[c] = src + (k0 + j + c) * ld;
                for (int64_t t = 0; t < d; t += 8) {
                    const float* at[8];
                    for (int c = 0; c < 8; ++c) at[c] = rows[c] + t;
                    transpose8(at, p + t * NR + j);
                }
            }
            continue;
        }
#endif
        for (int64_t j = 0; j < NR; ++j) {
            const int64_t key = k0 + j;
            if (key < limit) {
                const float* row = src + key * ld;
                for (int64_t t = 0; t < d; ++t) p[t * NR + j] = row[t];
            } else {
                for (int64_t t = 0; t < d; ++t) p[t * NR + j] = 0.f;
            }
        }
    }
}

// rows [0, n) of src (length d, stride ld) times f into dst (n_pad × dp), zeros around.
inline void pack_rows(const float* src, int64_t d, int64_t ld, int64_t n, int64_t n_pad, int64_t dp, float f,
                      float* dst) {
    for (int64_t r = 0; r < n_pad; ++r) {
        float* o = dst + r * dp;
        int64_t t = 0;
        if (r < n)
            for (; t < d; ++t) o[t] = src[r * ld + t] * f;
        for (; t < dp; ++t) o[t] = 0.f;
    }
}

// A block mask (P.tiles) on row i of head h: -inf in s[j] for the keys j of [a, e) that its
// tiles forbid (s indexed by key).
inline void tile_mask(const Problem& P, int64_t b, int64_t h, int64_t i, int64_t a, int64_t e, float* s) {
    const int64_t qb = i / P.bq;
    for (int64_t kb = a / P.bk; kb * P.bk < e; ++kb) {
        const int64_t k0 = std::max(a, kb * P.bk), k1 = std::min(e, (kb + 1) * P.bk);
        const int32_t t = tile_at(P, b, h, qb, kb);
        if (t == TILE_EMPTY) {
            std::fill(s + k0, s + k1, NEG_INF);
        } else if (t != TILE_FULL) {
            const uint8_t* m = P.partial + (int64_t(t) * P.bq + i % P.bq) * P.bk - kb * P.bk;
            for (int64_t j = k0; j < k1; ++j)
                if (!m[j]) s[j] = NEG_INF;
        }
    }
}

// Whether some tile of rows [i0, i0 + nr) × keys [j0, j1) may attend (true without a block mask).
inline bool any_tile(const Problem& P, int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t j0, int64_t j1) {
    if (!P.tiles) return true;
    for (int64_t qb = i0 / P.bq; qb <= (i0 + nr - 1) / P.bq; ++qb)
        for (int64_t kb = j0 / P.bk; kb * P.bk < j1; ++kb)
            if (tile_at(P, b, h, qb, kb) != TILE_EMPTY) return true;
    return false;
}

// The next run of keys [a', e) within [a, j1) (both panel aligned) that rows [i0, i0 + nr) may
// see by the block mask: its whole key blocks that are EMPTY for every row are left out
// (without a block mask, [a, j1) itself). Returns a' (j1 when none is left).
inline int64_t next_run(const Problem& P, int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t a, int64_t j1,
                        int64_t& e) {
    e = j1;
    if (!P.tiles) return a;
    auto block_end = [&](int64_t j) { return std::min(j1, (j / P.bk + 1) * P.bk); };
    while (a < j1 && !any_tile(P, b, h, i0, nr, a, block_end(a))) a = block_end(a);
    e = a;
    while (e < j1 && any_tile(P, b, h, i0, nr, e, block_end(e))) e = block_end(e);
    return a;
}

// One query row (head h, row i) against score columns [0, width) = keys j0 + j: s (base 2)
// and dp in, p · factor into p (if not null) and ds = p · factor · (dp − delta) into s out;
// Σ p (before the factor) added to *sum. Columns outside the row's span, past `valid`, or
// masked, and every column of a row with no key (lse = −inf), give p = ds = 0.
inline void row_p_ds(const Grad<float>& g, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t width,
                     int64_t valid, float* __restrict s, const float* __restrict dp, float* __restrict p,
                     float factor, float* sum) {
    const int64_t r = g.row(b, h, i);
    const float lse = g.lse[r];
    int64_t a, e;
    span(g.rule, i + g.Sk - g.Sq, a, e);
    a = std::clamp<int64_t>(a - j0, 0, width);
    e = std::clamp<int64_t>(std::min(e - j0, valid), a, width);
    if (!(lse > NEG_INF) || a == e) {
        std::fill(s, s + width, 0.f);
        if (p) std::fill(p, p + width, 0.f);
        return;
    }
    for (int64_t j = 0; j < a; ++j) s[j] = NEG_INF;
    for (int64_t j = e; j < width; ++j) s[j] = NEG_INF;
    if (const uint8_t* m = g.mrow(b, h, i))
        for (int64_t j = a; j < e; ++j)
            if (!m[(j0 + j) * g.ms[3]]) s[j] = NEG_INF;
    if (g.rule.tiles) tile_mask(g.rule, b, h, i, j0 + a, j0 + e, s - j0);
    if (g.bias) {  // the forward's bias, in base 2 like s (masked columns stay -inf)
        const float* row = g.bias + b * g.bs[0] + h * g.bs[1] + i * g.bs[2] + j0 * g.bs[3];
        for (int64_t j = a; j < e; ++j) s[j] += row[j * g.bs[3]] * LOG2E;
    }
    const vf l2 = splat(lse * LOG2E), dl = splat(g.delta[r]), f = splat(factor), zero = (vf){};
    vf total = zero;
    for (int64_t j = 0; j < width; j += W) {
        const vf pj = exp2v(load(s + j) - l2);
        total += pj;
        const vf pf = pj * f;
        if (p) store(p + j, pf);
        store(s + j, pj == zero ? zero : pf * (load(dp + j) - dl));
    }
    *sum += hsum(total);
}

struct F32Buffers {
    float *qb, *dob, *kp, *vp, *kn, *s, *dp, *p, *acc_a, *acc_b, *sums;
    bool ok() const { return qb && dob && kp && vp && kn && s && dp && p && acc_a && acc_b && sums; }
    void release() {
        for (float* x : {qb, dob, kp, vp, kn, s, dp, p, acc_a, acc_b, sums}) std::free(x);
    }
};

// Pass 1: dQ of rows [i0, i1) of the G heads of (b, kvh), and their normalisers
// 1 / Σ p (the stored lse is rounded; dividing by the recomputed Σ p undoes it, as in dq_tile).
void dq_item(const Grad<float>& g, F32Buffers& w, int64_t b, int64_t kvh, int64_t i0, int64_t i1) {
    const int64_t G = g.H / g.Hkv, D = g.D, Dv = g.Dv, Dp = round_up(D, W), rows = i1 - i0;
    const int64_t rpad = round_up(rows, MR);
    const float sc2 = g.scale * LOG2E;
    for (int64_t gi = 0; gi < G; ++gi) {
        const int64_t h = kvh * G + gi;
        pack_rows(g.qrow(b, h, i0), D, g.qs[2], rows, rpad, D, sc2, w.qb + gi * QT1 * D);
        pack_rows(g.dorow(b, h, i0), Dv, g.dos[2], rows, rpad, Dv, 1.f, w.dob + gi * QT1 * Dv);
    }
    std::fill(w.acc_a, w.acc_a + G * QT1 * Dp, 0.f);
    std::fill(w.sums, w.sums + G * QT1, 0.f);
    const float* kb = g.krow(b, kvh, 0);
    const float* vb = g.vrow(b, kvh, 0);
    const int64_t ldk = g.ks[2], ldv = g.vs[2];
    int64_t lo, hi;
    key_range(g.rule, i0, i1, lo, hi);
    lo = lo / NR * NR;
    for (int64_t c0 = lo; c0 < hi; c0 += KC1) {
        const int64_t c1 = std::min(c0 + KC1, hi), npan = (c1 - c0 + NR - 1) / NR;
        pack_panels(kb, D, ldk, c0, npan, g.Sk, w.kp);
        pack_panels(vb, Dv, ldv, c0, npan, g.Sk, w.vp);
        // K's rows as they are (at their stride) when they need no padding, else copied with zeros around.
        const bool in_place = D == Dp && c0 + npan * NR <= g.Sk;
        const float* kn = in_place ? kb + c0 * ldk : w.kn;
        const int64_t ldn = in_place ? ldk : Dp;
        if (!in_place) pack_rows(kb + c0 * ldk, D, ldk, std::min(npan * NR, g.Sk - c0), npan * NR, Dp, 1.f, w.kn);
        for (int64_t gi = 0; gi < G; ++gi) {
            const int64_t h = kvh * G + gi;
            for (int64_t r0 = 0; r0 < rows; r0 += MR) {
                const int64_t nr = std::min<int64_t>(MR, rows - r0);
                int64_t blo, bhi;
                key_range(g.rule, i0 + r0, i0 + r0 + nr, blo, bhi);
                blo = std::max(blo, c0);
                bhi = std::min(bhi, c1);
                if (bhi <= blo) continue;
                const int64_t ja = c0 + (blo - c0) / NR * NR, jb = c0 + (bhi - c0 + NR - 1) / NR * NR;
                const float* qt = w.qb + (gi * QT1 + r0) * D;
                const float* dot = w.dob + (gi * QT1 + r0) * Dv;
                int64_t j1;  // runs of keys [j0, j1): all of [ja, jb), or its key blocks a block mask leaves
                for (int64_t j0 = next_run(g.rule, b, h, i0 + r0, nr, ja, jb, j1); j0 < jb;
                     j0 = next_run(g.rule, b, h, i0 + r0, nr, j1, jb, j1)) {
                    const int64_t pa = (j0 - c0) / NR, pb = (j1 - c0) / NR;
                    const int64_t width = j1 - j0, valid = std::min(j1, g.Sk) - j0;
                    for (int64_t pan = pa; pan < pb; ++pan) {
                        qk_tile(qt, D, D, w.kp + pan * D * NR, w.s + (pan - pa) * NR, KC1, 1.f, QK_BLOCK_BACKWARD);
                        qk_tile(dot, Dv, Dv, w.vp + pan * Dv * NR, w.dp + (pan - pa) * NR, KC1, 1.f,
                                QK_BLOCK_BACKWARD);
                    }
                    for (int64_t i = 0; i < nr; ++i)
                        row_p_ds(g, b, h, i0 + r0 + i, j0, width, valid, w.s + i * KC1, w.dp + i * KC1, nullptr,
                                 1.f, w.sums + gi * QT1 + r0 + i);
                    acc_gemm(w.s, KC1, 1, nr, width, kn + (j0 - c0) * ldn, ldn, w.acc_a + (gi * QT1 + r0) * Dp, Dp,
                             Dp);
                }
            }
        }
    }
    for (int64_t gi = 0; gi < G; ++gi) {
        const int64_t h = kvh * G + gi;
        for (int64_t r = 0; r < rows; ++r) {
            const float sum = w.sums[gi * QT1 + r], inv = sum > 0.f ? 1.f / sum : 0.f;
            g.norm[g.row(b, h, i0 + r)] = inv;
            const float f = g.scale * inv;
            const float* src = w.acc_a + (gi * QT1 + r) * Dp;
            float* dst = g.dqrow(b, h, i0 + r);
            for (int64_t t = 0; t < D; ++t) dst[t] = src[t] * f;
        }
    }
}

// Query rows [lo, hi) whose spans meet keys [j0, j1): spans only move right as rows go
// down (the rule key_range relies on), so they are an interval, found by bisection.
void rows_meeting(const Grad<float>& g, int64_t j0, int64_t j1, int64_t& lo, int64_t& hi) {
    auto first = [&](auto pred) {  // first row where pred holds (pred monotone false -> true)
        int64_t a = 0, e = g.Sq;
        while (a < e) {
            const int64_t m = a + (e - a) / 2;
            int64_t sl, sh;
            span(g.rule, m + g.Sk - g.Sq, sl, sh);
            if (pred(sl, sh)) e = m; else a = m + 1;
        }
        return a;
    };
    lo = first([&](int64_t, int64_t sh) { return sh > j0; });
    hi = std::max(lo, first([&](int64_t sl, int64_t) { return sl >= j1; }));
}

// With g.dbias: zeros in rows [r0, r1) of head h, keys [j0, j0 + n) (rows whose ds are not computed).
inline void zero_dbias(const Grad<float>& g, int64_t b, int64_t h, int64_t r0, int64_t r1, int64_t j0, int64_t n) {
    if (!g.dbias) return;
    for (int64_t i = r0; i < r1; ++i) std::fill_n(g.dbias + g.row(b, h, i) * g.Sk + j0, n, 0.f);
}

// The fused pass's dQ / scale of the G query heads of a (b, K/V head): row (gi, i) of Dp floats
// at p + gi·hs + i·rs (g.dq itself when D is a multiple of W, else a buffer).
struct DqAcc {
    float* p;
    int64_t hs, rs;
    float* row(int64_t gi, int64_t i) const { return p + gi * hs + i * rs; }
};

// Pass 2: dK and dV of keys [j0, j1) of (b, kvh), summed over the G query heads. With dqa
// (the fused pass): also adds ds · K of these keys to dqa, p unnormalised.
void dkdv_item(const Grad<float>& g, F32Buffers& w, int64_t b, int64_t kvh, int64_t j0, int64_t j1,
               const DqAcc* dqa = nullptr) {
    const int64_t G = g.H / g.Hkv, D = g.D, Dv = g.Dv, Dp = round_up(D, W), Dvp = round_up(Dv, W);
    const int64_t n = j1 - j0, npan = (n + NR - 1) / NR, width = npan * NR;
    const float sc2 = g.scale * LOG2E;
    const float* kb = g.krow(b, kvh, 0);
    const float* vb = g.vrow(b, kvh, 0);
    pack_panels(kb, D, g.ks[2], j0, npan, j1, w.kp);
    pack_panels(vb, Dv, g.vs[2], j0, npan, j1, w.vp);
    const float* kn = g.krow(b, kvh, j0);  // K's rows for dQ: as they are (stride ldn), or padded to Dp
    int64_t ldn = g.ks[2];
    if (dqa && D != Dp) {
        pack_rows(kn, D, ldn, n, n, Dp, 1.f, w.kn);
        kn = w.kn;
        ldn = Dp;
    }
    std::fill(w.acc_a, w.acc_a + KB2 * Dp, 0.f);
    std::fill(w.acc_b, w.acc_b + KB2 * Dvp, 0.f);
    int64_t ilo, ihi;
    rows_meeting(g, j0, j1, ilo, ihi);
    float* drel = g.drel ? g.drel + (b * g.H + kvh * G) * g.drel_blocks * (g.Sq + g.Sk - 1) : nullptr;
    const int64_t drel_head = g.drel_blocks * (g.Sq + g.Sk - 1);  // its stride between heads
    if (drel && g.drel_blocks > 1) drel += j0 / KB2 * (g.Sq + g.Sk - 1);  // this block's vector
    for (int64_t gi = 0; gi < G; ++gi) {
        const int64_t h = kvh * G + gi;
        zero_dbias(g, b, h, 0, ilo, j0, n);  // rows that see none of these keys
        zero_dbias(g, b, h, ihi, g.Sq, j0, n);
        for (int64_t ib = ilo; ib < ihi; ib += QB2) {
            const int64_t nb = std::min(QB2, ihi - ib);
            if (!any_tile(g.rule, b, h, ib, nb, j0, j1)) {  // a block mask's empty tiles
                zero_dbias(g, b, h, ib, ib + nb, j0, n);
                continue;
            }
            pack_rows(g.qrow(b, h, ib), D, g.qs[2], nb, round_up(nb, MR), Dp, sc2, w.qb);
            pack_rows(g.dorow(b, h, ib), Dv, g.dos[2], nb, round_up(nb, MR), Dvp, 1.f, w.dob);
            for (int64_t r0 = 0; r0 < nb; r0 += MR) {
                // Rows whose tiles here are all EMPTY: no product (row_p_ds masks their garbage to p = ds = 0).
                const bool some = any_tile(g.rule, b, h, ib + r0, std::min<int64_t>(MR, nb - r0), j0, j1);
                for (int64_t pan = 0; some && pan < npan; ++pan) {
                    qk_tile(w.qb + r0 * Dp, Dp, D, w.kp + pan * D * NR, w.s + r0 * KB2 + pan * NR, KB2, 1.f,
                            QK_BLOCK_BACKWARD);
                    qk_tile(w.dob + r0 * Dvp, Dvp, Dv, w.vp + pan * Dv * NR, w.dp + r0 * KB2 + pan * NR, KB2, 1.f,
                            QK_BLOCK_BACKWARD);
                }
                for (int64_t i = r0; i < std::min(r0 + MR, nb); ++i) {
                    float unused = 0.f;
                    row_p_ds(g, b, h, ib + i, j0, width, n, w.s + i * KB2, w.dp + i * KB2, w.p + i * KB2,
                             dqa ? 1.f : g.norm[g.row(b, h, ib + i)], &unused);
                    if (g.dbias)  // ds is the bias' gradient (natural units, as the scores it is added to)
                        std::copy(w.s + i * KB2, w.s + i * KB2 + n, g.dbias + g.row(b, h, ib + i) * g.Sk + j0);
                    if (drel) {  // key j0 + j of row ib + i lies on diagonal j0 + j - (ib + i) + Sq - 1
                        float* diag = drel + gi * drel_head + j0 - (ib + i) + g.Sq - 1;
                        const float* ds = w.s + i * KB2;
                        for (int64_t j = 0; j < n; ++j) diag[j] += ds[j];
                    }
                }
            }
            acc_gemm(w.p, 1, KB2, n, nb, w.dob, Dvp, w.acc_b, Dvp, Dvp);  // dV += pᵀ · dO
            acc_gemm(w.s, 1, KB2, n, nb, w.qb, Dp, w.acc_a, Dp, Dp);      // dK += dsᵀ · q·scale·log2 e
            if (dqa) acc_gemm(w.s, KB2, 1, nb, n, kn, ldn, dqa->row(gi, ib), dqa->rs, Dp);  // dQ += ds · K
        }
    }
    const float ln2 = 0.6931471805599453f;
    for (int64_t j = 0; j < n; ++j) {
        float* dk = g.dkrow(b, kvh, j0 + j);
        float* dv = g.dvrow(b, kvh, j0 + j);
        for (int64_t t = 0; t < D; ++t) dk[t] = w.acc_a[j * Dp + t] * ln2;
        for (int64_t t = 0; t < Dv; ++t) dv[t] = w.acc_b[j * Dvp + t];
    }
}

// The fused pass: dQ, dK, dV of (b, kvh), its key blocks in order, dQ summed in place
// (g.dq itself, at its strides, when D is a multiple of W, else dqbuf: G × Sq × Dp). Five
// products per score instead of seven, the probabilities unnormalised (the stored lse's
// rounding is within the accuracy criterion: see the tests), parallel over (b, kvh) only.
void fused_item(const Grad<float>& g, F32Buffers& w, float* dqbuf, int64_t b, int64_t kvh) {
    const int64_t G = g.H / g.Hkv, D = g.D, Dp = round_up(D, W);
    const DqAcc dqa = D == Dp ? DqAcc{g.dqrow(b, kvh * G, 0), g.dqs[1], g.dqs[2]} : DqAcc{dqbuf, g.Sq * Dp, Dp};
    for (int64_t gi = 0; gi < G; ++gi)
        for (int64_t i = 0; i < g.Sq; ++i) std::fill(dqa.row(gi, i), dqa.row(gi, i) + Dp, 0.f);
    for (int64_t j0 = 0; j0 < g.Sk; j0 += KB2) dkdv_item(g, w, b, kvh, j0, std::min(j0 + KB2, g.Sk), &dqa);
    for (int64_t gi = 0; gi < G; ++gi)
        for (int64_t i = 0; i < g.Sq; ++i) {
            const float* src = dqa.row(gi, i);
            float* dst = g.dqrow(b, kvh * G + gi, i);
            for (int64_t t = 0; t < D; ++t) dst[t] = src[t] * g.scale;
        }
}

// Whether the fused pass runs: from FUSED_MIN_ITEMS (b, K/V head) pairs, a rule of the
// shapes alone (never of the thread count: the results must not depend on it).
constexpr int64_t FUSED_MIN_ITEMS = 4;

int backward_f32(Grad<float>& g, int threads) {
    if (g.B < 0 || g.Sq < 0 || g.Sk < 0 || g.Hkv <= 0 || g.H <= 0 || g.H % g.Hkv || g.D <= 0 || g.Dv <= 0) return -2;
    g.rule.Sq = g.Sq;
    g.rule.Sk = g.Sk;
    const int64_t G = g.H / g.Hkv, D = g.D, Dv = g.Dv, Dp = round_up(D, W), Dvp = round_up(Dv, W);
    const int64_t row_tiles = (g.Sq + QT1 - 1) / QT1, key_blocks = (g.Sk + KB2 - 1) / KB2;
    const int64_t items1 = g.B * g.Hkv * row_tiles, items2 = g.B * g.Hkv * key_blocks;
    const int64_t keys = std::max(KC1, KB2), qrows = std::max(G * QT1, QB2);
    const bool fused = g.B * g.Hkv >= FUSED_MIN_ITEMS;
    g.norm = alloc_t<float>(fused ? 1 : g.B * g.H * g.Sq);
    if (!g.norm) return -1;
    // The relative bias' gradient: the fused pass sums each (b, h)'s diagonals in order in the output;
    // the two passes, one vector per key block (summed below in block order: the same for any thread count).
    float* out_rel = g.drel;
    const int64_t ndiag = g.Sq + g.Sk - 1;
    g.drel_blocks = fused ? 1 : key_blocks;
    if (out_rel && !fused) {
        g.drel = static_cast<float*>(std::calloc(size_t(g.B * g.H * key_blocks * ndiag), sizeof(float)));
        if (!g.drel) { std::free(g.norm); return -1; }
    } else if (out_rel) {
        std::fill_n(out_rel, g.B * g.H * ndiag, 0.f);
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float* dqbuf = fused && D != Dp ? alloc(G * g.Sq * Dp) : nullptr;
        F32Buffers w{alloc(qrows * std::max(D, Dp)), alloc(qrows * std::max(Dv, Dvp)), alloc(keys * D),
                     alloc(keys * Dv), alloc(keys * Dp), alloc(std::max(MR * KC1, QB2 * KB2)),
                     alloc(std::max(MR * KC1, QB2 * KB2)), alloc(QB2 * KB2),
                     alloc(std::max(G * QT1 * Dp, KB2 * Dp)), alloc(KB2 * Dvp), alloc(G * QT1)};
        if (!w.ok() || (fused && D != Dp && !dqbuf)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed && fused) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < g.B * g.Hkv; ++it) fused_item(g, w, dqbuf, it / g.Hkv, it % g.Hkv);
        } else if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items1; ++it) {
                const int64_t tile = row_tiles - 1 - it % row_tiles, rest = it / row_tiles;  // long rows first
                const int64_t i0 = tile * QT1;
                dq_item(g, w, rest / g.Hkv, rest % g.Hkv, i0, std::min(i0 + QT1, g.Sq));
            }  // (implicit barrier: pass 2 reads every row's norm)
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items2; ++it) {
                const int64_t blk = it % key_blocks, rest = it / key_blocks;  // causal: long blocks first
                const int64_t j0 = blk * KB2;
                dkdv_item(g, w, rest / g.Hkv, rest % g.Hkv, j0, std::min(j0 + KB2, g.Sk));
            }
        }
        w.release();
        std::free(dqbuf);
    }
    std::free(g.norm);
    if (out_rel && !fused) {
        for (int64_t bh = 0; bh < g.B * g.H; ++bh)
            for (int64_t t = 0; t < ndiag; ++t) {
                float sum = 0.f;
                for (int64_t blk = 0; blk < key_blocks; ++blk) sum += g.drel[(bh * key_blocks + blk) * ndiag + t];
                out_rel[bh * ndiag + t] = sum;
            }
        std::free(g.drel);
        g.drel = out_rel;
    }
    return failed ? -1 : 0;
}

// strides: q, k, v, dout, dq, dk, dv (b, h, s) and the mask (b, h, i, j): 25 int64.
template <typename T>
void set_strides(Grad<T>& g, const int64_t* strides) {
    int64_t* rows[7] = {g.qs, g.ks, g.vs, g.dos, g.dqs, g.dks, g.dvs};
    for (int t = 0; t < 7; ++t)
        for (int i = 0; i < 3; ++i) rows[t][i] = strides[3 * t + i];
    for (int i = 0; i < 4; ++i) g.ms[i] = strides[21 + i];
}

// What the float32 backward takes beyond the plain problem: a block mask, a bias and its gradient.
struct Extra {
    const Problem* blocks;
    const float* bias;
    const int64_t* bias_strides;
    float* dbias;
    float* drel;
};

template <typename T>
int run_backward(const T* q, const T* k, const T* v, const T* dout, const T* lse, const T* delta,
                 const uint8_t* mask, T* dq, T* dk, T* dv, const int64_t* dims, const int64_t* strides,
                 double scale, int causal, int64_t window, int threads, const Extra* extra = nullptr) {
    Grad<T> g{};
    if (extra) {  // the block mask and the bias (float32 only: read by its loops)
        const Problem* blocks = extra->blocks;
        g.rule.tiles = blocks->tiles;
        for (int i = 0; i < 4; ++i) g.rule.ts[i] = blocks->ts[i];
        g.rule.bq = blocks->bq;
        g.rule.bk = blocks->bk;
        g.rule.partial = blocks->partial;
        g.bias = extra->bias;
        if (g.bias)
            for (int i = 0; i < 4; ++i) g.bs[i] = extra->bias_strides[i];
        g.dbias = extra->dbias;
        g.drel = extra->drel;
    }
    g.q = q; g.k = k; g.v = v; g.dout = dout; g.lse = lse; g.delta = delta; g.mask = mask;
    g.dq = dq; g.dk = dk; g.dv = dv;
    g.B = dims[0]; g.H = dims[1]; g.Hkv = dims[2]; g.Sq = dims[3]; g.Sk = dims[4]; g.D = dims[5]; g.Dv = dims[6];
    set_strides(g, strides);
    g.scale = T(scale);
    g.rule.causal = causal != 0;
    g.rule.window = window;
    if constexpr (std::is_same_v<T, float>) return backward_f32(g, threads);
    else return backward(g, threads);
}

// A plain float64 forward (out and lse), the twin of the float32 kernels' results: it
// lets gradcheck compare the backward above with finite differences in float64.
void forward_f64_row(const Grad<double>& g, int64_t b, int64_t h, int64_t i, double* s, double* out, double* lse) {
    int64_t a, e;
    const int64_t r = g.row(b, h, i);
    double* o = out + r * g.Dv;
    std::fill(o, o + g.Dv, 0.0);
    lse[r] = -std::numeric_limits<double>::infinity();
    if (!visible(g, i, 0, g.Sk, a, e)) return;
    const int64_t kv = h / (g.H / g.Hkv);
    const uint8_t* m = g.mrow(b, h, i);
    double top = -std::numeric_limits<double>::infinity();
    for (int64_t j = a; j < e; ++j) {
        s[j] = (m && !m[j * g.ms[3]]) ? -std::numeric_limits<double>::infinity()
                                      : g.scale * dot_t(g.qrow(b, h, i), g.krow(b, kv, j), g.D);
        top = std::max(top, s[j]);
    }
    if (top == -std::numeric_limits<double>::infinity()) return;
    double sum = 0.0;
    for (int64_t j = a; j < e; ++j) {
        s[j] = std::exp(s[j] - top);
        sum += s[j];
        axpy(s[j], g.vrow(b, kv, j), o, g.Dv);
    }
    for (int64_t t = 0; t < g.Dv; ++t) o[t] /= sum;
    lse[r] = top + std::log(sum);
}

}  // namespace

// q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), dout (B, H, Sq, Dv) -> dq, dk, dv
// (shaped like q, k, v): each with contiguous rows (last dim) at any strides (b, h, s); lse and
// delta (B, H, Sq) contiguous; mask bytes or null. dims: B, H, Hkv, Sq, Sk, D, Dv. strides (25):
// q, k, v, dout, dq, dk, dv (b, h, s), then the mask's (b, h, i, j). The results do not depend
// on the strides (bitwise).
// tiles, tile_info, partial: null, or a block mask as the forward takes it (mask then null):
// tiles that are EMPTY for a block of rows cost no product. bias, bias_strides: null, or the
// forward's additive bias (float32, read at its 4 strides (b, h, i, j), which may be negative or 0);
// dbias: null, or (B, H, Sq, Sk) contiguous float32, where the bias' gradient (ds, 0 where masked) is
// written (the caller sums it over the bias' broadcast dims); drel: null, or (B, H, Sq + Sk - 1)
// contiguous float32, where the sums of ds along the diagonals are written, [b, h, j - i + Sq - 1]
// (a relative bias' gradient; no (Sq, Sk) matrix is made).
extern "C" int mh_attention_backward_f32(const float* q, const float* k, const float* v, const float* dout,
                                         const float* lse, const float* delta, const uint8_t* mask, float* dq,
                                         float* dk, float* dv, const int64_t* dims, const int64_t* strides,
                                         double scale, int causal, int64_t window, const int32_t* tiles,
                                         const int64_t* tile_info, const uint8_t* partial, const float* bias,
                                         const int64_t* bias_strides, float* dbias, float* drel, int threads) {
    Problem blocks{};
    if (tiles && !set_block_mask(blocks, tiles, tile_info, partial, mask)) return -2;
    if ((bias && !bias_strides) || ((dbias || drel) && !bias)) return -2;
    Extra extra{&blocks, bias, bias_strides, dbias, drel};
    return run_backward(q, k, v, dout, lse, delta, mask, dq, dk, dv, dims, strides, scale, causal, window, threads,
                        &extra);
}

extern "C" int mh_attention_backward_f64(const double* q, const double* k, const double* v, const double* dout,
                                         const double* lse, const double* delta, const uint8_t* mask, double* dq,
                                         double* dk, double* dv, const int64_t* dims, const int64_t* strides,
                                         double scale, int causal, int64_t window, int threads) {
    return run_backward(q, k, v, dout, lse, delta, mask, dq, dk, dv, dims, strides, scale, causal, window, threads);
}

// The float64 forward: out (B, H, Sq, Dv) and lse (B, H, Sq), contiguous; q, k, v and the mask
// as above, with the backward's 25 strides (those of dout, dq, dk, dv unread).
extern "C" int mh_attention_forward_f64(const double* q, const double* k, const double* v, const uint8_t* mask,
                                        double* out, double* lse, const int64_t* dims, const int64_t* strides,
                                        double scale, int causal, int64_t window, int threads) {
    Grad<double> g{};
    g.q = q; g.k = k; g.v = v; g.mask = mask;
    g.B = dims[0]; g.H = dims[1]; g.Hkv = dims[2]; g.Sq = dims[3]; g.Sk = dims[4]; g.D = dims[5]; g.Dv = dims[6];
    if (g.B < 0 || g.Sq < 0 || g.Sk < 0 || g.Hkv <= 0 || g.H <= 0 || g.H % g.Hkv || g.D <= 0 || g.Dv <= 0) return -2;
    set_strides(g, strides);
    g.scale = scale;
    g.rule.causal = causal != 0;
    g.rule.window = window;
    g.rule.Sq = g.Sq;
    g.rule.Sk = g.Sk;
    const int64_t rows = g.B * g.H * g.Sq;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        double* s = alloc_t<double>(g.Sk);
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; ++r)
                forward_f64_row(g, r / (g.H * g.Sq), r / g.Sq % g.H, r % g.Sq, s, out, lse);
        }
        std::free(s);
    }
    return failed ? -1 : 0;
}
