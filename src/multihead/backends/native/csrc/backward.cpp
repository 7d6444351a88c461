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
// Templated on the scalar (float for use, double so that torch.autograd.gradcheck can
// check this very code in float64). Returns 0, or -1 out of memory, -2 bad shape.

#include <limits>

#include "common.h"

namespace {

using namespace mh;

constexpr int64_t KB = 64;    // keys per dK/dV block (pass 1)
constexpr int64_t QT = 16;    // query rows per dQ tile (pass 2)
constexpr int64_t KC2 = 256;  // keys per chunk of pass 2 (its K and V stay in L2)

template <typename T>
struct Grad {
    const T *q, *k, *v, *dout, *lse, *delta;  // contiguous: (B, H, Sq, D), (B, Hkv, Sk, D|Dv), (B, H, Sq, Dv), (B, H, Sq) ×2
    const uint8_t* mask;                      // nullptr or bool bytes with strides ms (b, h, i, j)
    T *dq, *dk, *dv;                          // contiguous, like q, k, v
    T* norm;  // (B, H, Sq): 1 / Σ_j exp(s_ij − lse_i) as recomputed here (pass 2), ≈ 1
    int64_t B, H, Hkv, Sq, Sk, D, Dv, ms[4];
    T scale;
    Problem rule;  // dims, causal, window: what mh::span reads

    const T* qrow(int64_t b, int64_t h, int64_t i) const { return q + ((b * H + h) * Sq + i) * D; }
    const T* dorow(int64_t b, int64_t h, int64_t i) const { return dout + ((b * H + h) * Sq + i) * Dv; }
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

// out[j] = x · rows[j] for j < n (rows of length d, stride d): dot products.
template <typename T>
inline void dots(const T* __restrict x, const T* __restrict rows, int64_t n, int64_t d, T* __restrict out) {
    for (int64_t j = 0; j < n; ++j) out[j] = dot_t(x, rows + j * d, d);
}
// float: W rows at a time, their W sums reduced together (common.h), when d allows.
inline void dots(const float* __restrict x, const float* __restrict rows, int64_t n, int64_t d,
                 float* __restrict out) {
    int64_t j = 0;
    if (d % W == 0)
        for (; j + W <= n; j += W) store(out + j, dot_w(x, rows + j * d, d, d));
    for (; j < n; ++j) out[j] = dot_t(x, rows + j * d, d);
}

// x[j] = exp(x[j] − c) for j < n (x[j] = −inf gives 0). float: the vector exp2 of
// common.h (its relative error is below float32 rounding); double: std::exp.
inline void exp_shift(float* x, int64_t n, float c) {
    const float log2e = 1.4426950408889634f;
    const vf cv = splat(c * log2e);
    int64_t j = 0;
    for (; j + W <= n; j += W) store(x + j, exp2v(load(x + j) * log2e - cv));
    if (j < n) {
        alignas(64) float tail[W];
        for (int64_t t = 0; t < W; ++t) tail[t] = j + t < n ? x[j + t] : NEG_INF;
        store(tail, exp2v(load(tail) * log2e - cv));
        for (int64_t t = 0; j + t < n; ++t) x[j + t] = tail[t];
    }
}
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
    const T* kb = g.k + (b * g.Hkv + kv) * g.Sk * g.D;
    const T* vb = g.v + (b * g.Hkv + kv) * g.Sk * g.Dv;
    const uint8_t* m = g.mrow(b, h, i);
    const T neg_inf = -std::numeric_limits<T>::infinity();
    dots(qi, kb + a * g.D, e - a, g.D, p);
    for (int64_t j = a; j < e; ++j)
        p[j - a] = (m && !m[j * g.ms[3]]) ? neg_inf : g.scale * p[j - a];
    exp_shift(p, e - a, lse);
    T total = 0;
    for (int64_t j = 0; j < e - a; ++j) total += p[j];
    *sum += total;
    if (factor != T(1))
        for (int64_t j = 0; j < e - a; ++j) p[j] *= factor;
    const T delta = g.delta[r];
    dots(doi, vb + a * g.Dv, e - a, g.Dv, ds);  // dp
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

// y (d) += Σ_j c[j] · rows[j] (n rows of length d, stride d).
template <typename T>
inline void combine(T* __restrict y, const T* __restrict c, const T* __restrict rows, int64_t n, int64_t d) {
    for (int64_t j = 0; j < n; ++j)
        if (c[j] != T(0)) axpy(c[j], rows + j * d, y, d);
}
// float, d = W·NV: y kept in NV registers across the n rows.
template <int NV>
inline void combine_v(float* __restrict y, const float* __restrict c, const float* __restrict rows, int64_t n) {
    vf acc[NV];
#pragma GCC unroll 8
    for (int t = 0; t < NV; ++t) acc[t] = load(y + W * t);
    for (int64_t j = 0; j < n; ++j) {
        const vf cj = splat(c[j]);
#pragma GCC unroll 8
        for (int t = 0; t < NV; ++t) acc[t] += cj * load(rows + j * W * NV + W * t);
    }
#pragma GCC unroll 8
    for (int t = 0; t < NV; ++t) store(y + W * t, acc[t]);
}
inline void combine(float* __restrict y, const float* __restrict c, const float* __restrict rows, int64_t n,
                    int64_t d) {
    switch (d % W ? 0 : d / W) {
        case 1: return combine_v<1>(y, c, rows, n);
        case 2: return combine_v<2>(y, c, rows, n);
        case 3: return combine_v<3>(y, c, rows, n);
        case 4: return combine_v<4>(y, c, rows, n);
        case 5: return combine_v<5>(y, c, rows, n);
        case 6: return combine_v<6>(y, c, rows, n);
        case 7: return combine_v<7>(y, c, rows, n);
        case 8: return combine_v<8>(y, c, rows, n);
        default:
            for (int64_t j = 0; j < n; ++j)
                if (c[j] != 0.f) axpy(c[j], rows + j * d, y, d);
    }
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
    std::copy(acc_k, acc_k + n * g.D, g.dk + ((b * g.Hkv + kvh) * g.Sk + j0) * g.D);
    std::copy(acc_v, acc_v + n * g.Dv, g.dv + ((b * g.Hkv + kvh) * g.Sk + j0) * g.Dv);
}

// Pass 1: dQ of rows [i0, i1) of (b, h), and their normalisers.
template <typename T>
void dq_tile(const Grad<T>& g, int64_t b, int64_t h, int64_t i0, int64_t i1, T* acc, T* p, T* ds) {
    const int64_t kv = h / (g.H / g.Hkv);
    const T* kb = g.k + (b * g.Hkv + kv) * g.Sk * g.D;
    std::fill(acc, acc + (i1 - i0) * g.D, T(0));
    T* sums = g.norm + g.row(b, h, i0);
    std::fill(sums, sums + (i1 - i0), T(0));
    for (int64_t c0 = 0; c0 < g.Sk; c0 += KC2) {
        const int64_t c1 = std::min(c0 + KC2, g.Sk);
        for (int64_t i = i0; i < i1; ++i) {
            int64_t a, e;
            if (!visible(g, i, c0, c1, a, e) || !row_grads(g, b, h, i, a, e, p, ds, T(1), sums + (i - i0))) continue;
            T* __restrict dqi = acc + (i - i0) * g.D;
            const T* __restrict kr = kb + a * g.D;
            const int64_t n = e - a, d = g.D;
            for (int64_t j = 0; j < n; ++j) ds[j] *= g.scale;
            combine(dqi, ds, kr, n, d);
        }
    }
    // The stored lse is rounded (float32: up to half an ulp of |lse|, the same relative
    // error for every p of the row); Σ p recomputed here undoes it. ds is linear in p,
    // so dq is rescaled at the end and pass 1 scales its p by the same factor.
    for (int64_t i = 0; i < i1 - i0; ++i) {
        sums[i] = sums[i] > T(0) ? T(1) / sums[i] : T(0);
        for (int64_t t = 0; t < g.D; ++t) acc[i * g.D + t] *= sums[i];
    }
    std::copy(acc, acc + (i1 - i0) * g.D, g.dq + g.row(b, h, i0) * g.D);
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

template <typename T>
int run_backward(const T* q, const T* k, const T* v, const T* dout, const T* lse, const T* delta,
                 const uint8_t* mask, T* dq, T* dk, T* dv, const int64_t* dims, const int64_t* mask_strides,
                 double scale, int causal, int64_t window, int threads) {
    Grad<T> g{};
    g.q = q; g.k = k; g.v = v; g.dout = dout; g.lse = lse; g.delta = delta; g.mask = mask;
    g.dq = dq; g.dk = dk; g.dv = dv;
    g.B = dims[0]; g.H = dims[1]; g.Hkv = dims[2]; g.Sq = dims[3]; g.Sk = dims[4]; g.D = dims[5]; g.Dv = dims[6];
    for (int i = 0; i < 4; ++i) g.ms[i] = mask_strides[i];
    g.scale = T(scale);
    g.rule.causal = causal != 0;
    g.rule.window = window;
    return backward(g, threads);
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
    const double* kb = g.k + (b * g.Hkv + kv) * g.Sk * g.D;
    const double* vb = g.v + (b * g.Hkv + kv) * g.Sk * g.Dv;
    const uint8_t* m = g.mrow(b, h, i);
    double top = -std::numeric_limits<double>::infinity();
    for (int64_t j = a; j < e; ++j) {
        s[j] = (m && !m[j * g.ms[3]]) ? -std::numeric_limits<double>::infinity()
                                      : g.scale * dot_t(g.qrow(b, h, i), kb + j * g.D, g.D);
        top = std::max(top, s[j]);
    }
    if (top == -std::numeric_limits<double>::infinity()) return;
    double sum = 0.0;
    for (int64_t j = a; j < e; ++j) {
        s[j] = std::exp(s[j] - top);
        sum += s[j];
        axpy(s[j], vb + j * g.Dv, o, g.Dv);
    }
    for (int64_t t = 0; t < g.Dv; ++t) o[t] /= sum;
    lse[r] = top + std::log(sum);
}

}  // namespace

// q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), dout (B, H, Sq, Dv), lse and
// delta (B, H, Sq), all contiguous; mask bytes with strides (b, h, i, j) or null ->
// dq, dk, dv (contiguous, like q, k, v). dims: B, H, Hkv, Sq, Sk, D, Dv.
extern "C" int mh_attention_backward_f32(const float* q, const float* k, const float* v, const float* dout,
                                         const float* lse, const float* delta, const uint8_t* mask, float* dq,
                                         float* dk, float* dv, const int64_t* dims, const int64_t* mask_strides,
                                         double scale, int causal, int64_t window, int threads) {
    return run_backward(q, k, v, dout, lse, delta, mask, dq, dk, dv, dims, mask_strides, scale, causal, window,
                        threads);
}

extern "C" int mh_attention_backward_f64(const double* q, const double* k, const double* v, const double* dout,
                                         const double* lse, const double* delta, const uint8_t* mask, double* dq,
                                         double* dk, double* dv, const int64_t* dims, const int64_t* mask_strides,
                                         double scale, int causal, int64_t window, int threads) {
    return run_backward(q, k, v, dout, lse, delta, mask, dq, dk, dv, dims, mask_strides, scale, causal, window,
                        threads);
}

// The float64 forward: out (B, H, Sq, Dv) and lse (B, H, Sq), contiguous; inputs as above.
extern "C" int mh_attention_forward_f64(const double* q, const double* k, const double* v, const uint8_t* mask,
                                        double* out, double* lse, const int64_t* dims, const int64_t* mask_strides,
                                        double scale, int causal, int64_t window, int threads) {
    Grad<double> g{};
    g.q = q; g.k = k; g.v = v; g.mask = mask;
    g.B = dims[0]; g.H = dims[1]; g.Hkv = dims[2]; g.Sq = dims[3]; g.Sk = dims[4]; g.D = dims[5]; g.Dv = dims[6];
    if (g.B < 0 || g.Sq < 0 || g.Sk < 0 || g.Hkv <= 0 || g.H <= 0 || g.H % g.Hkv || g.D <= 0 || g.Dv <= 0) return -2;
    for (int i = 0; i < 4; ++i) g.ms[i] = mask_strides[i];
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
