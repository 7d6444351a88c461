// Memory check of the native kernels, compiled by tests/test_native.py with
// AddressSanitizer and UndefinedBehaviorSanitizer around them: random problems whose
// tensors are allocated at their exact size (any read or write outside them aborts), the
// attention results compared with a float64 loop. Every entry point runs in float32,
// bfloat16 and float16 (half precision tensors are uint16 buffers of their exact size); the
// FlashAttention loop also with block masks and additive biases (dense, or relative: a vector
// per head read along diagonals at a negative stride), and the float32 backward with them and
// the bias' gradients.
// Prints "ok <count>" and exits 0.
//
// Layouts as the Python side passes them: q (B, H, Sq, D), k (B, Hkv, Sk, D),
// v (B, Hkv, Sk, Dv), out (B, H, Sq, Dv), with strides (b, h, s) in elements, last dim 1.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

extern "C" {
int mh_attention_f32(const float*, const float*, const float*, float*, float*, const uint8_t*, const int64_t*,
                     const int64_t*, float, int, int64_t, float, const float*, const float*, const int64_t*, int64_t,
                     int64_t*, const int32_t*, const int64_t*, const uint8_t*, const float*, const int64_t*, int64_t, int);
int mh_decode_f32(const float*, const float*, const float*, float*, float*, const uint8_t*, const int64_t*,
                  const int64_t*, float, int, int64_t, int);
int mh_linear_few_rows_f32(const float*, int64_t, int64_t, int64_t, const float* const*, const int64_t*,
                           const float* const*, float* const*, int);
int mh_decode_step_f32(const float*, int64_t, int64_t, const float* const*, const float* const*, int64_t, int64_t,
                       int64_t, const float*, const float*, int64_t, int, const float* const*, float, int, float*,
                       float*, const int64_t*, int64_t*, float, int64_t, const int64_t*, float*, float*, int,
                       int64_t*, int64_t, int64_t);
#define MH_HALF(suffix)                                                                                          \
    int mh_attention_##suffix(const void*, const void*, const void*, void*, float*, const uint8_t*,              \
                              const int64_t*, const int64_t*, float, int, int64_t, float, const float*,          \
                              const float*, const int64_t*, int64_t, int64_t*, const int32_t*, const int64_t*,   \
                              const uint8_t*, const float*, const int64_t*, int64_t, int);                       \
    int mh_decode_##suffix(const void*, const void*, const void*, void*, float*, const uint8_t*, const int64_t*, \
                           const int64_t*, float, int, int64_t, int);                                            \
    int mh_decode_step_##suffix(const void*, int64_t, int64_t, const void* const*, const void* const*, int64_t,  \
                                int64_t, int64_t, const float*, const float*, int64_t, int, const void* const*,  \
                                float, int, void*, void*, const int64_t*, int64_t*, float, int64_t,             \
                                const int64_t*, void*, void*, int, int64_t*, int64_t, int64_t);
MH_HALF(bf16)
MH_HALF(f16)
int mh_convert_scalar(int, int, const void*, void*, int64_t);
int mh_attention_backward_f32(const float*, const float*, const float*, const float*, const float*, const float*,
                              const uint8_t*, float*, float*, float*, const int64_t*, const int64_t*, double, int,
                              int64_t, const int32_t*, const int64_t*, const uint8_t*, const float*, const int64_t*,
                              float*, float*, int);
}

// Element types: F32 float32, BF16 and F16 (uint16 buffers, converted by the library's scalar code).
enum Kind { F32 = -1, BF16 = 0, F16 = 1 };
static const char* kind_name(int kind) { return kind == F32 ? "f32" : kind == BF16 ? "bf16" : "f16"; }

// x rounded to the kind (in place: the float32 values the kernel will see) and, for half
// kinds, its bits in a buffer of exactly x.size() elements.
static std::vector<uint16_t> to_kind(int kind, std::vector<float>& x) {
    if (kind == F32) return {};
    std::vector<uint16_t> h(x.size());
    mh_convert_scalar(kind, 1, x.data(), h.data(), int64_t(x.size()));
    mh_convert_scalar(kind, 0, h.data(), x.data(), int64_t(x.size()));
    return h;
}
static void from_kind(int kind, const std::vector<uint16_t>& h, std::vector<float>& x) {
    if (kind != F32) mh_convert_scalar(kind, 0, h.data(), x.data(), int64_t(x.size()));
}
// The data pointer the kernel gets: the float32 buffer or the half one.
static void* data(int kind, std::vector<float>& x, std::vector<uint16_t>& h) {
    return kind == F32 ? static_cast<void*>(x.data()) : static_cast<void*>(h.data());
}

static uint64_t state = 12345;
static uint64_t next() { state = state * 6364136223846793005ULL + 1442695040888963407ULL; return state >> 33; }
static int64_t pick(int64_t lo, int64_t hi) { return lo + int64_t(next() % uint64_t(hi - lo + 1)); }
static float unit() { return float(next() % 20001) / 10000.f - 1.f; }
static std::vector<float> randoms(int64_t n) { std::vector<float> v(n); for (auto& x : v) x = unit(); return v; }

// A random block mask for (B|1, 1, Sq, Sk): tiles of bq × bk (bk a multiple of 32), each EMPTY (-1),
// FULL (-2) or partial (its bytes at partial[p]), shared by the batch or one per row.
struct Blocks {
    int64_t bq = 0, bk = 0, nq = 0, nk = 0, per_batch = 0;
    std::vector<int32_t> tiles;
    std::vector<uint8_t> partial;
    int64_t info[6] = {};
    bool allows(int64_t b, int64_t i, int64_t j) const {
        const int32_t t = tiles[(per_batch ? b : 0) * nq * nk + (i / bq) * nk + j / bk];
        return t == -2 || (t >= 0 && partial[(int64_t(t) * bq + i % bq) * bk + j % bk]);
    }
};
static Blocks random_blocks(int64_t B, int64_t Sq, int64_t Sk);
// A random additive bias: dense (B|1, H, Sq, Sk), or relative (1, H, Sq + Sk - 1), read by the kernels
// at `ptr` with strides (b, h, i, j) (relative: from element Sq - 1 of a head's vector, i stride -1).
struct Bias {
    bool relative = false;
    std::vector<float> values;
    int64_t strides[4] = {};
    const float* ptr = nullptr;
    int64_t Sq = 0, Sk = 0, H = 0, per_batch = 0;
    double at(int64_t b, int64_t h, int64_t i, int64_t j) const {
        if (relative) return values[h * (Sq + Sk - 1) + j - i + Sq - 1];
        return values[((per_batch ? b : 0) * H + h) * Sq * Sk + i * Sk + j];
    }
};
static Bias random_bias(int64_t B, int64_t H, int64_t Sq, int64_t Sk) {
    Bias bias;
    bias.relative = next() % 2;
    bias.Sq = Sq; bias.Sk = Sk; bias.H = H;
    if (bias.relative) {
        bias.values = randoms(H * (Sq + Sk - 1));
        bias.ptr = bias.values.data() + (Sq - 1);
        const int64_t st[4] = {0, Sq + Sk - 1, -1, 1};
        std::copy(st, st + 4, bias.strides);
    } else {
        bias.per_batch = next() % 2;
        bias.values = randoms((bias.per_batch ? B : 1) * H * Sq * Sk);
        bias.ptr = bias.values.data();
        const int64_t st[4] = {bias.per_batch ? H * Sq * Sk : 0, Sq * Sk, Sk, 1};
        std::copy(st, st + 4, bias.strides);
    }
    return bias;
}

// Whether key j is in the span of the query at key position pos: causal and window (0 = none) as the kernels'.
static bool in_span(bool causal, int64_t window, int64_t j, int64_t pos) {
    bool ok = !causal || j <= pos;
    if (window) ok = ok && j > pos - window && (causal || j < pos + window);
    return ok;
}

static int fail(const char* what, double got, double want) {
    std::printf("FAIL %s: got %g want %g\n", what, got, want);
    return 1;
}

// One attention problem through mh_attention_* or mh_decode_* (kind), checked against float64.
static int attention_case(bool decode, int kind) {
    const int64_t B = pick(1, 2), Hkv = pick(1, 3), G = pick(1, 4), H = Hkv * G;
    int64_t Sq = decode ? pick(1, 3) : pick(1, 70), Sk = pick(decode ? 1 : 1, decode ? 2200 : 90);
    // The logit features and packed sequences (the FlashAttention loop only).
    const bool packed = !decode && next() % 3 == 0;
    if (packed) Sq = Sk;
    const float softcap = !decode && next() % 3 == 0 ? float(pick(1, 30)) / 10.f : 0.f;
    const bool alibi = !decode && next() % 3 == 0, sinking = !decode && next() % 3 == 0;
    // Half the time multiples of 16: the decoding loop's register-blocked path (half precision).
    const bool sixteens = next() % 2;
    const int64_t D = sixteens ? 16 * pick(1, 3) : pick(1, 40), Dv = sixteens ? 16 * pick(1, 3) : pick(1, 40);
    const bool causal = next() % 2, strided = next() % 2;
    const bool tiled = !decode && next() % 3 == 0, masked = !tiled && next() % 3 == 0;
    const bool biased = !decode && next() % 3 == 0;
    const int64_t window = next() % 3 == 0 ? pick(1, 20) : 0;
    // Strided: the (B, S, H, D) buffers the module makes, seen as (B, H, S, D).
    const int64_t qs[3] = {H * Sq * D, strided ? D : Sq * D, strided ? H * D : D};
    const int64_t ks[3] = {Hkv * Sk * D, strided ? D : Sk * D, strided ? Hkv * D : D};
    const int64_t vs[3] = {Hkv * Sk * Dv, strided ? Dv : Sk * Dv, strided ? Hkv * Dv : Dv};
    const int64_t os[3] = {H * Sq * Dv, Dv, H * Dv};
    std::vector<float> q = randoms(B * H * Sq * D), k = randoms(B * Hkv * Sk * D), v = randoms(B * Hkv * Sk * Dv);
    std::vector<float> out(B * H * Sq * Dv, NAN);
    std::vector<uint16_t> qh = to_kind(kind, q), kh = to_kind(kind, k), vh = to_kind(kind, v);
    std::vector<uint16_t> oh(kind == F32 ? 0 : out.size(), 0x7FFF);  // NaN bits until written
    const bool with_lse = next() % 2;
    std::vector<float> lse(with_lse ? B * H * Sq : 0, NAN);  // exact size: (B, H, Sq)
    std::vector<uint8_t> mask(masked ? Sq * Sk : 0);  // (Sq, Sk) broadcast over B and H
    for (auto& m : mask) m = next() % 4 != 0;
    int64_t dims[7] = {B, H, Hkv, Sq, Sk, D, Dv};
    int64_t strides[19] = {qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], os[0], os[1], os[2],
                           0, 0, masked ? Sk : 0, masked ? 1 : 0, H * Sq, Sq, 1};
    float* lp = with_lse ? lse.data() : nullptr;
    const float scale = 1.f / std::sqrt(float(D));
    std::vector<float> slopes(alibi ? H : 0), sinks(sinking ? H : 0);  // exact sizes
    for (auto& x : slopes) x = (unit() + 1.f) / 4.f;
    for (auto& x : sinks) x = 2.f * unit();
    const bool per_row = next() % 2;  // one packing per batch row, or one for all
    const int64_t rows = per_row ? B : 1;
    std::vector<int64_t> seg(packed ? rows * 2 * Sk : 0);  // (B|1, 2, Sk): [start, end) of each token's sequence
    for (int64_t r = 0; r < (packed ? rows : 0); ++r)
        for (int64_t start = 0; start < Sk;) {
            const int64_t end = std::min(Sk, start + pick(1, 12));
            for (int64_t t = start; t < end; ++t) { seg[r * 2 * Sk + t] = start; seg[r * 2 * Sk + Sk + t] = end; }
            start = end;
        }
    int64_t panels = 0;
    const uint8_t* mp = masked ? mask.data() : nullptr;
    Blocks blocks = tiled ? random_blocks(B, Sq, Sk) : Blocks{};
    Bias bias = biased ? random_bias(B, H, Sq, Sk) : Bias{};
    const int32_t* tp = tiled ? blocks.tiles.data() : nullptr;
    const int64_t* ti = tiled ? blocks.info : nullptr;
    const uint8_t* pp = tiled ? blocks.partial.data() : nullptr;
    const float* bp = biased ? bias.ptr : nullptr;
    const int64_t* bs = biased ? bias.strides : nullptr;
    const void *qp = data(kind, q, qh), *kp = data(kind, k, kh), *vp = data(kind, v, vh);
    void* op = data(kind, out, oh);
    const int64_t tile = pick(1, 48);
    const float* al = alibi ? slopes.data() : nullptr;
    const float* sk = sinking ? sinks.data() : nullptr;
    const int64_t* sg = packed ? seg.data() : nullptr;
    const int64_t sbs = per_row ? 2 * Sk : 0;
    int code;
    if (decode)
        code = (kind == F32 ? mh_decode_f32(q.data(), k.data(), v.data(), out.data(), lp, mp, dims, strides, scale,
                                            causal, window, 2)
                : kind == BF16 ? mh_decode_bf16(qp, kp, vp, op, lp, mp, dims, strides, scale, causal, window, 2)
                               : mh_decode_f16(qp, kp, vp, op, lp, mp, dims, strides, scale, causal, window, 2));
    else
        code = (kind == F32 ? mh_attention_f32(q.data(), k.data(), v.data(), out.data(), lp, mp, dims, strides, scale,
                                               causal, window, softcap, al, sk, sg, sbs, &panels, tp, ti, pp, bp, bs, tile, 2)
                : kind == BF16 ? mh_attention_bf16(qp, kp, vp, op, lp, mp, dims, strides, scale, causal, window,
                                                   softcap, al, sk, sg, sbs, &panels, tp, ti, pp, bp, bs, tile, 2)
                               : mh_attention_f16(qp, kp, vp, op, lp, mp, dims, strides, scale, causal, window,
                                                  softcap, al, sk, sg, sbs, &panels, tp, ti, pp, bp, bs, tile, 2));
    if (code != 0) return fail("return code", code, 0);
    from_kind(kind, oh, out);
    // |out| <= 1: float32 within 1e-4; half precision adds one rounding of out (2^-9, 2^-12).
    const double tol = kind == F32 ? 1e-4 : kind == BF16 ? 4e-3 : 1e-3;
    const int64_t off = Sk - Sq;
    std::vector<double> s(Sk);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < Sq; ++i) {
                const int64_t g = h / G, pos = i + off;
                double top = -INFINITY;
                for (int64_t j = 0; j < Sk; ++j) {
                    bool ok = in_span(causal, window, j, pos) && (!masked || mask[i * Sk + j]) &&
                              (!tiled || blocks.allows(b, i, j));
                    if (packed) {
                        const int64_t* sg = seg.data() + (per_row ? b : 0) * 2 * Sk;
                        ok = ok && j >= sg[pos] && j < sg[Sk + pos];
                    }
                    double dot = 0;
                    for (int64_t t = 0; t < D; ++t)
                        dot += double(q[b * qs[0] + h * qs[1] + i * qs[2] + t]) * k[b * ks[0] + g * ks[1] + j * ks[2] + t];
                    dot *= scale;
                    if (softcap > 0.f) dot = softcap * std::tanh(dot / softcap);
                    if (alibi) dot -= slopes[h] * double(std::abs(pos - j));
                    if (biased) dot += bias.at(b, h, i, j);
                    s[j] = ok ? dot : -INFINITY;
                    if (s[j] > top) top = s[j];
                }
                double total = 0;
                for (int64_t j = 0; j < Sk; ++j) total += s[j] == -INFINITY ? 0 : std::exp(s[j] - top);
                const double keys = total;  // the lse leaves the sink out
                if (sinking && total > 0) total += std::exp(double(sinks[h]) - top);
                for (int64_t t = 0; t < Dv; ++t) {
                    double want = 0;
                    for (int64_t j = 0; j < Sk; ++j)
                        if (s[j] != -INFINITY) want += std::exp(s[j] - top) / total * v[b * vs[0] + g * vs[1] + j * vs[2] + t];
                    const double got = out[b * os[0] + h * os[1] + i * os[2] + t];
                    if (!(std::fabs(got - want) <= tol)) return fail(decode ? "decode" : "attention", got, want);
                }
                if (with_lse) {  // log-sum-exp of the row, -inf with no key
                    const double want = keys > 0 ? top + std::log(keys) : -INFINITY;
                    const double got = lse[(b * H + h) * Sq + i];
                    if (!(got == want || std::fabs(got - want) <= 1e-4 * (1 + std::fabs(want))))
                        return fail(decode ? "decode lse" : "attention lse", got, want);
                }
            }
    return 0;
}

static Blocks random_blocks(int64_t B, int64_t Sq, int64_t Sk) {
    Blocks m;
    m.bq = pick(1, 24);
    m.bk = 32 * pick(1, 2);
    m.nq = (Sq + m.bq - 1) / m.bq;
    m.nk = (Sk + m.bk - 1) / m.bk;
    m.per_batch = next() % 2;
    const int64_t rows = m.per_batch ? B : 1;
    m.tiles.resize(rows * m.nq * m.nk);
    int32_t count = 0;
    for (auto& t : m.tiles) {
        const uint64_t c = next() % 3;
        t = c == 0 ? -1 : c == 1 ? -2 : count++;
    }
    m.partial.resize(size_t(count) * m.bq * m.bk);  // exactly the partial tiles' bytes
    for (auto& x : m.partial) x = next() % 3 != 0;
    const int64_t info[6] = {m.per_batch ? m.nq * m.nk : 0, 0, m.nk, 1, m.bq, m.bk};
    std::copy(info, info + 6, m.info);
    return m;
}

// The float32 backward on a random problem with a block mask and/or a bias (dense or relative) and
// its gradients (dbias, drel), against float64 gradients of the same rule.
static int backward_case() {
    const int64_t B = pick(1, 2), Hkv = pick(1, 3), G = pick(1, 3), H = Hkv * G;
    const int64_t Sq = pick(1, 60), Sk = pick(1, 80), D = pick(1, 40), Dv = pick(1, 40);
    const bool causal = next() % 2, tiled = next() % 2, biased = next() % 4 != 0;
    const int64_t window = next() % 3 == 0 ? pick(1, 20) : 0;
    Blocks blocks = tiled ? random_blocks(B, Sq, Sk) : Blocks{};
    Bias bias = biased ? random_bias(B, H, Sq, Sk) : Bias{};
    std::vector<float> q = randoms(B * H * Sq * D), k = randoms(B * Hkv * Sk * D), v = randoms(B * Hkv * Sk * Dv);
    std::vector<float> dout = randoms(B * H * Sq * Dv), out(B * H * Sq * Dv, NAN), lse(B * H * Sq, NAN);
    const int64_t dims[7] = {B, H, Hkv, Sq, Sk, D, Dv};
    const int64_t fwd[19] = {H * Sq * D, Sq * D, D, Hkv * Sk * D, Sk * D, D, Hkv * Sk * Dv, Sk * Dv, Dv,
                             H * Sq * Dv, Sq * Dv, Dv, 0, 0, 0, 0, H * Sq, Sq, 1};
    const float scale = 1.f / std::sqrt(float(D));
    const int32_t* tp = tiled ? blocks.tiles.data() : nullptr;
    const int64_t* ti = tiled ? blocks.info : nullptr;
    const uint8_t* pp = tiled ? blocks.partial.data() : nullptr;
    const float* bp = biased ? bias.ptr : nullptr;
    const int64_t* bs = biased ? bias.strides : nullptr;
    int code = mh_attention_f32(q.data(), k.data(), v.data(), out.data(), lse.data(), nullptr, dims, fwd, scale, causal,
                                window, 0.f, nullptr, nullptr, nullptr, 0, nullptr, tp, ti, pp, bp, bs, pick(1, 48), 2);
    if (code != 0) return fail("backward's forward return code", code, 0);
    std::vector<float> delta(B * H * Sq);
    for (int64_t r = 0; r < B * H * Sq; ++r) {
        double d = 0;
        for (int64_t t = 0; t < Dv; ++t) d += double(dout[r * Dv + t]) * out[r * Dv + t];
        delta[r] = float(d);
    }
    std::vector<float> dq(q.size(), NAN), dk(k.size(), NAN), dv(v.size(), NAN);
    const bool want_dense = biased && next() % 2, want_rel = biased && next() % 2;
    std::vector<float> dbias(want_dense ? B * H * Sq * Sk : 0, NAN), drel(want_rel ? B * H * (Sq + Sk - 1) : 0, NAN);
    const int64_t bwd[25] = {H * Sq * D, Sq * D, D, Hkv * Sk * D, Sk * D, D, Hkv * Sk * Dv, Sk * Dv, Dv,
                             H * Sq * Dv, Sq * Dv, Dv, H * Sq * D, Sq * D, D, Hkv * Sk * D, Sk * D, D,
                             Hkv * Sk * Dv, Sk * Dv, Dv, 0, 0, 0, 0};
    code = mh_attention_backward_f32(q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(), nullptr,
                                     dq.data(), dk.data(), dv.data(), dims, bwd, scale, causal, window, tp, ti, pp, bp,
                                     bs, want_dense ? dbias.data() : nullptr, want_rel ? drel.data() : nullptr, 2);
    if (code != 0) return fail("backward return code", code, 0);
    // float64: p, then ds = p·(dp − Σ p·dp); every gradient summed from them.
    std::vector<double> wq(q.size()), wk(k.size()), wv(v.size()), wb(B * H * Sq * Sk), wr(B * H * (Sq + Sk - 1));
    std::vector<double> p(Sk), dp(Sk);
    const int64_t off = Sk - Sq;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < Sq; ++i) {
                const int64_t g = h / G, pos = i + off;
                double top = -INFINITY;
                for (int64_t j = 0; j < Sk; ++j) {
                    const bool ok = in_span(causal, window, j, pos) && (!tiled || blocks.allows(b, i, j));
                    double dot = 0;
                    for (int64_t t = 0; t < D; ++t) dot += double(q[((b * H + h) * Sq + i) * D + t]) * k[((b * Hkv + g) * Sk + j) * D + t];
                    dot = dot * scale + (biased ? bias.at(b, h, i, j) : 0.0);
                    p[j] = ok ? dot : -INFINITY;
                    top = std::max(top, p[j]);
                }
                double total = 0;
                for (int64_t j = 0; j < Sk; ++j) total += p[j] == -INFINITY ? 0 : std::exp(p[j] - top);
                double pdp = 0;
                for (int64_t j = 0; j < Sk; ++j) {
                    p[j] = p[j] == -INFINITY ? 0 : std::exp(p[j] - top) / total;
                    dp[j] = 0;
                    for (int64_t t = 0; t < Dv; ++t) dp[j] += double(dout[((b * H + h) * Sq + i) * Dv + t]) * v[((b * Hkv + g) * Sk + j) * Dv + t];
                    pdp += p[j] * dp[j];
                }
                for (int64_t j = 0; j < Sk; ++j) {
                    const double ds = p[j] * (dp[j] - pdp);
                    wb[((b * H + h) * Sq + i) * Sk + j] = ds;
                    wr[(b * H + h) * (Sq + Sk - 1) + j - i + Sq - 1] += ds;
                    for (int64_t t = 0; t < Dv; ++t) wv[((b * Hkv + g) * Sk + j) * Dv + t] += p[j] * dout[((b * H + h) * Sq + i) * Dv + t];
                    for (int64_t t = 0; t < D; ++t) {
                        wq[((b * H + h) * Sq + i) * D + t] += scale * ds * k[((b * Hkv + g) * Sk + j) * D + t];
                        wk[((b * Hkv + g) * Sk + j) * D + t] += scale * ds * q[((b * H + h) * Sq + i) * D + t];
                    }
                }
            }
    auto close = [](const std::vector<float>& got, const std::vector<double>& want, const char* what) {
        for (size_t n = 0; n < got.size(); ++n)
            if (!(std::fabs(got[n] - want[n]) <= 2e-3 * (1 + std::fabs(want[n])))) return fail(what, got[n], want[n]);
        return 0;
    };
    if (close(dq, wq, "backward dq") || close(dk, wk, "backward dk") || close(dv, wv, "backward dv")) return 1;
    if (want_dense && close(dbias, wb, "backward dbias")) return 1;
    if (want_rel && close(drel, wr, "backward drel")) return 1;
    return 0;
}

static int linear_case() {
    const int64_t M = pick(1, 8), K = pick(1, 70), count = pick(1, 3);
    std::vector<float> x = randoms(M * K);
    std::vector<std::vector<float>> w, bias, out;
    std::vector<int64_t> N;
    for (int64_t i = 0; i < count; ++i) {
        N.push_back(pick(1, 37));
        w.push_back(randoms(N[i] * K));
        bias.push_back(next() % 2 ? randoms(N[i]) : std::vector<float>());
        out.push_back(std::vector<float>(M * N[i], NAN));
    }
    std::vector<const float*> wp, bp;
    std::vector<float*> op;
    for (int64_t i = 0; i < count; ++i) {
        wp.push_back(w[i].data());
        bp.push_back(bias[i].empty() ? nullptr : bias[i].data());
        op.push_back(out[i].data());
    }
    if (mh_linear_few_rows_f32(x.data(), M, K, count, wp.data(), N.data(), bp.data(), op.data(), 2) != 0)
        return fail("linear return code", 1, 0);
    for (int64_t i = 0; i < count; ++i)
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N[i]; ++n) {
                double want = bias[i].empty() ? 0 : bias[i][n];
                for (int64_t t = 0; t < K; ++t) want += double(x[m * K + t]) * w[i][n * K + t];
                if (!(std::fabs(out[i][m * N[i] + n] - want) <= 1e-4)) return fail("linear", out[i][m * N[i] + n], want);
            }
    return 0;
}

// The fused step: exact-size buffers, every row's slot written, outputs finite (its
// values are compared with the step-by-step path in tests/test_native.py).
static int step_case(int kind) {
    // E and H·D multiples of 16 half the time: the bf16 projections' de-interleaved x and heads.
    const int64_t B = pick(1, 8), Hkv = pick(1, 3), H = Hkv * pick(1, 3);
    const int64_t D = next() % 2 ? 16 * pick(1, 3) : 2 * pick(1, 20), E = next() % 2 ? 16 * pick(1, 4) : pick(1, 50);
    const int64_t C = pick(2, 700), R = 2 * pick(0, D / 2), P = C + 1;
    std::vector<float> x = randoms(B * E), wq = randoms(H * D * E), wk = randoms(Hkv * D * E), wv = randoms(Hkv * D * E);
    std::vector<float> wo = randoms(E * H * D), bq = randoms(H * D), bo = randoms(E);
    std::vector<float> cos = randoms(P * (R / 2)), sin = randoms(P * (R / 2));
    std::vector<float> ck = randoms(B * Hkv * C * D), cv = randoms(B * Hkv * C * D), y(B * E, NAN);
    std::vector<int64_t> lengths(B);
    for (auto& n : lengths) n = pick(0, C - 1);
    const float* W[4] = {wq.data(), wk.data(), wv.data(), wo.data()};
    const float* bias[4] = {bq.data(), nullptr, nullptr, bo.data()};
    int64_t cs[3] = {Hkv * C * D, C * D, D};
    std::vector<int64_t> before = lengths;
    const float* cp = R ? cos.data() : nullptr;
    const float* sp = R ? sin.data() : nullptr;
    const int inter = int(next() % 2);
    // QK-norm: none, per head before or after RoPE (weights of exactly D), or across the projection
    // before it (weights of exactly H·D and Hkv·D); its scale w or 1 + w
    const int norm_mode = int(next() % 4) | (next() % 2 ? 4 : 0);
    std::vector<float> qn = randoms((norm_mode & 3) == 3 ? H * D : D), kn = randoms((norm_mode & 3) == 3 ? Hkv * D : D);
    const float* norms[2] = {qn.data(), kn.data()};
    const int64_t window = next() % 2 ? 0 : pick(1, C);  // none, or a sliding window of 1 .. C keys
    const bool with_starts = next() % 2;  // left padding: each row's first slot, 0 .. its new token's
    std::vector<int64_t> starts(B);
    for (int64_t b = 0; b < B; ++b) starts[b] = pick(0, lengths[b]);
    int code;
    std::vector<float> old_slots(B * 2 * Hkv * D), saved(B * 2 * Hkv * D, -1.f);  // (B, 2, Hkv, D)
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hkv; ++h)
            for (int64_t t = 0; t < D; ++t) {
                old_slots[((b * 2) * Hkv + h) * D + t] = ck[b * cs[0] + h * cs[1] + lengths[b] * cs[2] + t];
                old_slots[((b * 2 + 1) * Hkv + h) * D + t] = cv[b * cs[0] + h * cs[1] + lengths[b] * cs[2] + t];
            }
    std::vector<int64_t> slot_pos(B * C, -1);  // (B, C): given (float32 here), the step advances the counters
    if (kind == F32) {
        code = mh_decode_step_f32(x.data(), B, E, W, bias, H, Hkv, D, cp, sp, R, inter, norm_mode & 3 ? norms : nullptr,
                                  1e-6f, norm_mode & 3 ? norm_mode : 0, ck.data(), cv.data(), cs,
                                  lengths.data(), 0.3f, window, with_starts ? starts.data() : nullptr, y.data(),
                                  saved.data(), 2, slot_pos.data(), C, C);
        for (size_t i = 0; code == 0 && i < saved.size(); ++i)  // the slots' old values, for a restore
            if (saved[i] != old_slots[i]) return fail("step saved slots", saved[i], old_slots[i]);
    } else {
        std::vector<uint16_t> xh = to_kind(kind, x), wqh = to_kind(kind, wq), wkh = to_kind(kind, wk);
        std::vector<uint16_t> wvh = to_kind(kind, wv), woh = to_kind(kind, wo), bqh = to_kind(kind, bq);
        std::vector<uint16_t> boh = to_kind(kind, bo), ckh = to_kind(kind, ck), cvh = to_kind(kind, cv);
        std::vector<uint16_t> yh(y.size(), 0x7FFF);
        const void* Wh[4] = {wqh.data(), wkh.data(), wvh.data(), woh.data()};
        const void* bh[4] = {bqh.data(), nullptr, nullptr, boh.data()};
        std::vector<uint16_t> qnh = to_kind(kind, qn), knh = to_kind(kind, kn);
        const void* nh[2] = {qnh.data(), knh.data()};
        code = (kind == BF16 ? mh_decode_step_bf16 : mh_decode_step_f16)(
            xh.data(), B, E, Wh, bh, H, Hkv, D, cp, sp, R, inter, norm_mode & 3 ? nh : nullptr, 1e-6f,
            norm_mode & 3 ? norm_mode : 0, ckh.data(), cvh.data(), cs, lengths.data(), 0.3f, window,
            with_starts ? starts.data() : nullptr, yh.data(), nullptr, 2, nullptr, 0, 0);
        from_kind(kind, yh, y);
    }
    if (code != 0) return fail("step return code", 1, 0);
    for (int64_t b = 0; b < B; ++b) {  // advanced where slot_pos was given (float32), else left to the caller
        const int64_t want = before[b] + (kind == F32 ? 1 : 0);
        if (lengths[b] != want) return fail("step lengths", lengths[b], want);
        if (kind == F32 && slot_pos[b * C + before[b]] != before[b])
            return fail("step slot_pos", slot_pos[b * C + before[b]], before[b]);
    }
    for (float t : y)
        if (!std::isfinite(t)) return fail("step output", t, 0);
    return 0;
}

int main(int argc, char** argv) {
    const int cases = argc > 1 ? std::atoi(argv[1]) : 200;
    for (int c = 0; c < cases; ++c) {
        for (int kind : {F32, BF16, F16})
            if (attention_case(false, kind) || attention_case(true, kind) || step_case(kind)) {
                std::printf("(%s)\n", kind_name(kind));
                return 1;
            }
        if (linear_case() || backward_case()) return 1;
    }
    std::printf("ok %d\n", cases);
    return 0;
}
