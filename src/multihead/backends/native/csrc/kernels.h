// The C entry points of multihead's native kernels, declared once: every unit that defines one
// includes this header (so a definition that differs from its declaration does not compile),
// and module.cpp, the Python module that calls them, takes each argument's type from here.
//
// Every function returns 0 on success, -1 when it could not allocate its buffers, -2 (or
// another negative code) when it refuses the problem. Strides are in elements.
#pragma once

#include <cstdint>

extern "C" {

// Attention, the FlashAttention loop: q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv),
// out (B, H, Sq, Dv), lse (B, H, Sq) or null, mask (B, H, Sq, Sk) bytes or null; dims
// (B, H, Hkv, Sq, Sk, D, Dv); strides (19: q, k, v, out (b, h, s), mask (b, h, i, j), lse (b, h, s));
// softcap (0 = off), ALiBi slopes (H) or null, sinks (H) or null, segments (B|1, 2, S) or null,
// their batch stride, panel counter or null; the query tile; threads.
int mh_attention_f32(const float* q, const float* k, const float* v, float* out, float* lse, const uint8_t* mask,
                     const int64_t* dims, const int64_t* strides, float scale, int causal, int64_t window,
                     float softcap, const float* alibi, const float* sinks, const int64_t* seg, int64_t seg_bs,
                     int64_t* panels, const int32_t* tiles,
                                const int64_t* tile_info, const uint8_t* partial, const float* bias,
                                const int64_t* bias_strides, int64_t query_tile, int threads);
int mh_attention_bf16(const void* q, const void* k, const void* v, void* out, float* lse, const uint8_t* mask,
                      const int64_t* dims, const int64_t* strides, float scale, int causal, int64_t window,
                      float softcap, const float* alibi, const float* sinks, const int64_t* seg, int64_t seg_bs,
                      int64_t* panels, const int32_t* tiles,
                                const int64_t* tile_info, const uint8_t* partial, const float* bias,
                                const int64_t* bias_strides, int64_t query_tile, int threads);
int mh_attention_f16(const void* q, const void* k, const void* v, void* out, float* lse, const uint8_t* mask,
                     const int64_t* dims, const int64_t* strides, float scale, int causal, int64_t window,
                     float softcap, const float* alibi, const float* sinks, const int64_t* seg, int64_t seg_bs,
                     int64_t* panels, const int32_t* tiles,
                                const int64_t* tile_info, const uint8_t* partial, const float* bias,
                                const int64_t* bias_strides, int64_t query_tile, int threads);

// The decoding loop (few query rows per K/V head): the FlashAttention loop's first 11 arguments.
int mh_decode_f32(const float* q, const float* k, const float* v, float* out, float* lse, const uint8_t* mask,
                  const int64_t* dims, const int64_t* strides, float scale, int causal, int64_t window, int threads);
int mh_decode_bf16(const void* q, const void* k, const void* v, void* out, float* lse, const uint8_t* mask,
                   const int64_t* dims, const int64_t* strides, float scale, int causal, int64_t window, int threads);
int mh_decode_f16(const void* q, const void* k, const void* v, void* out, float* lse, const uint8_t* mask,
                  const int64_t* dims, const int64_t* strides, float scale, int causal, int64_t window, int threads);

// FlashAttention-2's backward, and the float64 forward of the same rule: dims as above; strides
// (25: q, k, v, dout, dq, dk, dv (b, h, s), mask (b, h, i, j)); float32 also a block mask, an
// additive bias (its 4 strides, any sign), its gradient dbias (B, H, Sq, Sk) and that gradient's
// sums along diagonals drel (B, H, Sq + Sk - 1), or nulls.
int mh_attention_backward_f32(const float* q, const float* k, const float* v, const float* dout, const float* lse,
                              const float* delta, const uint8_t* mask, float* dq, float* dk, float* dv,
                              const int64_t* dims, const int64_t* strides, double scale, int causal, int64_t window,
                              const int32_t* tiles, const int64_t* tile_info, const uint8_t* partial,
                              const float* bias, const int64_t* bias_strides, float* dbias, float* drel,
                              int threads);
int mh_attention_backward_f64(const double* q, const double* k, const double* v, const double* dout,
                              const double* lse, const double* delta, const uint8_t* mask, double* dq, double* dk,
                              double* dv, const int64_t* dims, const int64_t* strides, double scale, int causal,
                              int64_t window, int threads);
int mh_attention_forward_f64(const double* q, const double* k, const double* v, const uint8_t* mask, double* out,
                             double* lse, const int64_t* dims, const int64_t* strides, double scale, int causal,
                             int64_t window, int threads);

// Decoding a token: x (M, K) times each of `count` weights W_i (N_i, K) plus bias_i, into out_i.
int mh_linear_few_rows_f32(const float* x, int64_t M, int64_t K, int64_t count, const float* const* W,
                           const int64_t* N, const float* const* bias, float* const* out, int threads);
// A layer's whole decoding step: x (B, E); weights and biases of q, k, v, o; H, Hkv, D; RoPE cos,
// sin (float32 or null), rotary dim, interleaved; QK-norm: the q and k weights (D each, of the
// step's type) or null, eps, where (0 none, 1 before RoPE, 2 after it; + 4: the scale is 1 + w);
// cache k, v (B, Hkv, C, D), their strides (3),
// lengths (B); scale; window (0: none; a sliding window, as span()); starts (B) or null: each
// row's first slot (left padding before it: never attended, RoPE positions count from it); y
// (B, E); saved slots (B, 2, Hkv, D) or null; threads; slot_pos (B × C, row stride) or null,
// its row stride, C (given: the counters are advanced too).
int mh_decode_step_f32(const float* x, int64_t B, int64_t E, const float* const* W, const float* const* bias,
                       int64_t H, int64_t Hkv, int64_t D, const float* rope_cos, const float* rope_sin,
                       int64_t rotary_dim, int interleaved, const float* const* norms, float norm_eps,
                       int norm_mode, float* cache_k, float* cache_v,
                       const int64_t* cache_strides, int64_t* lengths, float scale, int64_t window,
                       const int64_t* starts, float* y,
                       float* saved, int threads, int64_t* slot_pos, int64_t slot_ld, int64_t capacity);
int mh_decode_step_bf16(const void* x, int64_t B, int64_t E, const void* const* W, const void* const* bias,
                        int64_t H, int64_t Hkv, int64_t D, const float* rope_cos, const float* rope_sin,
                        int64_t rotary_dim, int interleaved, const void* const* norms, float norm_eps,
                        int norm_mode, void* cache_k, void* cache_v,
                        const int64_t* cache_strides, int64_t* lengths, float scale, int64_t window,
                        const int64_t* starts, void* y,
                        void* saved, int threads, int64_t* slot_pos, int64_t slot_ld, int64_t capacity);
int mh_decode_step_f16(const void* x, int64_t B, int64_t E, const void* const* W, const void* const* bias,
                       int64_t H, int64_t Hkv, int64_t D, const float* rope_cos, const float* rope_sin,
                       int64_t rotary_dim, int interleaved, const void* const* norms, float norm_eps,
                       int norm_mode, void* cache_k, void* cache_v,
                       const int64_t* cache_strides, int64_t* lengths, float scale, int64_t window,
                       const int64_t* starts, void* y,
                       void* saved, int threads, int64_t* slot_pos, int64_t slot_ld, int64_t capacity);
// A cache's counters after one token per row: lengths (B), slot_pos (B × C, row stride ld).
int mh_advance_counters(int64_t* lengths, int64_t* slot_pos, int64_t rows, int64_t ld, int64_t capacity);

// kind (0 bfloat16, 1 float16), to_half, src, dst, n: the scalar conversions (tests).
int mh_convert_scalar(int kind, int to_half, const void* src, void* dst, int64_t n);
int mh_vector_bits();     // 512, 256 or 128: the width this unit was compiled for
int mh_amx_ready();       // 1 where mh_attention_bf16 runs its AMX loop now
int mh_amx_switch(int on);  // on (1) or off (0); returns the previous position
int mh_max_step_rows();

}  // extern "C"
