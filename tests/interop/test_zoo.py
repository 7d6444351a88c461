"""The zoo: every model type of the installed transformers is patched exactly or refused.

Two passes, because patching decides by class (``hf_registry.REGISTRY``):

* **every model type** (822 in transformers 5.24): its modeling module is imported and, where
  it could hold a registered class or a module that dispatches through transformers'
  ``AttentionInterface``, its model is built on ``meta`` and patched: each type's routes
  (``"wrapper"``, ``"kernel"``, both), ``"refused"``, ``"no attention"`` or ``"unbuildable"``.
  A type holding a registered class must be in ``ZOO`` below, so that it is compared; a
  composite whose attention modules are all registered classes in ``COMPOSITES`` (or, with why,
  ``COMPOSITES_UNCOMPARED``); the kernel route's types are compared in test_kernel_zoo.py; the HF
  guide's counts are these, the count of types compared exact on the patch route among them.
  Types whose modeling module does not import are counted and listed.
* **every accepted type** (``ZOO``): built from a tiny config (E=64, H=4, Hkv=2 where the
  class has GQA, 2 layers, windows shrunk to 6 with 9 tokens, every 2-D weight ×4 so that
  attention is far from uniform), run on a right-padded and a left-padded batch, patched,
  run again:
  relative difference ≤ 1e-5 on real tokens, and the same greedy tokens for generators.
  Encoder-decoders (BART and its copies, mBART, Whisper) compare the encoder's states and the decoder's
  logits, cross-attention included, on padded encoder and decoder batches.

``test_zoo_catches_rope_planted_in_vit`` plants the mistake this file exists to catch
(RoPE added to ViT) and requires the comparison to report it; the other ``test_zoo_catches_*``
plant each family's own rule wrong (a RoPE pairing, a no-RoPE layer, a window, a rotary width).
``test_patched_model_fills_hf_cache_as_hf_does``: for every decoder, the prompt's keys and values
the patched model writes into HF's cache equal those HF writes.

Runtime: about 4 minutes on 2 shared cores (75 s of it building every model type on meta).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import pkgutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.backends import native
from multihead.interop import hf_registry, hf_wrappers

transformers = pytest.importorskip("transformers")
from transformers import AutoModel, AutoModelForCausalLM  # noqa: E402
from transformers.models.auto.configuration_auto import (CONFIG_MAPPING, CONFIG_MAPPING_NAMES,  # noqa: E402
                                                          model_type_to_module_name)

B, S, VOCAB, RTOL = 2, 9, 100, 1e-5
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "intermediate_size": 128, "vocab_size": VOCAB, "max_position_embeddings": 64, "n_embd": 64, "n_head": 4,
        "n_layer": 2, "image_size": 32, "patch_size": 8, "num_channels": 3, "sliding_window": 6,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

#: The tiny sizes under the names of BART, mBART and Whisper's configs.
_S2S = {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "decoder_start_token_id": 2}
#: The time-series encoder-decoders: 6 past steps (+2 lags) in, 4 predicted.
_TS = {"prediction_length": 4, "context_length": 6, "lags_sequence": [1, 2], "num_time_features": 1}
#: DeepSeek (issue #15): latent attention needs num_key_value_heads == num_attention_heads; a
#: small MoE (from layer 1); yarn with mscale / mscale_all_dim (the softmax scale changes).
#: More settings are compared in tests/interop/test_deepseek.py.
DEEPSEEK = {"num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 12,
            "qk_rope_head_dim": 8, "v_head_dim": 10, "n_routed_experts": 8, "n_group": 2, "topk_group": 1,
            "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_intermediate_size": 32,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.8}}

#: Llama 4 text: layer 0 rotates (interleaved), L2-normalises q and k and attends inside chunks of 4
#: tokens; layer 1 has no RoPE, attends fully causally and scales q by position (floor_scale 3: from
#: position 2 on). More in tests/interop/test_llama4.py.
LLAMA4 = {"head_dim": 16, "attention_chunk_size": 4, "no_rope_layers": [1, 0], "floor_scale": 3, "attn_scale": 0.5,
          "num_local_experts": 2, "intermediate_size_mlp": 128}

#: Qwen3-VL text: M-RoPE over D = 16 (8 slots: T H W T H W T T).
QWEN3_VL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
#: Accepted model types: (extra config fields, generator?). Their classes are registered.
ZOO: dict[str, tuple[dict[str, Any], bool]] = {
    "llama": ({"attention_bias": True}, True),
    "exaone": ({}, True), "internlm3": ({}, True), "iquestcoder": ({}, True),  # LlamaAttention, own configs
    "mistral": ({}, True),
    "mixtral": ({"num_local_experts": 2}, True),
    "qwen2": ({"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True}, True),
    "gemma": ({"head_dim": 16}, True),
    "granite": ({"attention_multiplier": 0.3}, True),
    "olmo": ({}, True),
    "starcoder2": ({}, True),
    "cohere": ({}, True),
    "qwen3": ({"head_dim": 16, "layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True},
              True),
    "olmo2": ({}, True),
    "phi3": ({"partial_rotary_factor": 0.5, "original_max_position_embeddings": 4, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "long_factor": [1.0, 1.5, 2.0, 2.5], "short_factor": [1.0, 1.1, 1.2, 1.3],
        "original_max_position_embeddings": 4}}, True),
    "gemma2": ({"head_dim": 16, "query_pre_attn_scalar": 12, "attn_logit_softcapping": 3.0}, True),
    "gemma3_text": ({"head_dim": 16, "query_pre_attn_scalar": 12, "layer_types": ["sliding_attention",
                     "full_attention"], "rope_parameters": {
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}}, True),
    "gpt_oss": ({"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2}, True),
    "gpt2": ({}, True),
    "bert": ({}, False),
    "dpr": ({}, False),  # BertAttention inside DPRQuestionEncoder
    "roberta": ({}, False),
    "xlm-roberta": ({}, False),
    "electra": ({"embedding_size": 64}, False),
    "vit": ({}, False),
    # fused query_key_value (more variants in tests/interop/test_fused_qkv_families.py)
    "gpt_neox": ({"rotary_pct": 0.5}, True),
    "falcon": ({"new_decoder_architecture": True, "num_kv_heads": 2, "bias": True}, True),
    "bloom": ({}, True),
    # ---- out_proj and DistilBERT families (issue #15 item 8) ----
    "clip_text_model": ({}, False),  # causal through the is_causal=True its encoder passes
    "clip_vision_model": ({}, False),
    "siglip_text_model": ({}, False),  # bidirectional, pooled from the last token
    "siglip_vision_model": ({}, False),  # its pooling head (torch's MHA) left alone by name
    "opt": ({"ffn_dim": 128, "word_embed_proj_dim": 64}, True),
    "bart": (_S2S, True),
    "mbart": (_S2S, True),
    "whisper": ({**_S2S, "num_mel_bins": 8, "max_source_positions": 16, "max_target_positions": 64}, True),
    # BART's copies (hf_registry._BART_COPIES): more in tests/interop/test_out_proj_families.py
    "pegasus": (_S2S, True), "marian": (_S2S, True), "plbart": (_S2S, True), "m2m_100": (_S2S, True),
    "blenderbot": (_S2S, True), "blenderbot-small": (_S2S, True),
    "biogpt": ({}, True),  # decoder-only, BART's attention class
    "nllb-moe": ({**_S2S, "num_experts": 4, "expert_capacity": 8, "encoder_sparse_step": 2, "decoder_sparse_step": 2},
                 True),  # layer 1 of each stack is a mixture of experts
    "speech_to_text": ({**_S2S, "input_feat_per_channel": 8, "conv_channels": 32, "max_source_positions": 64,
                        "max_target_positions": 64}, True),
    "time_series_transformer": ({**_S2S, **_TS}, False),  # encoder and decoder states (no masks, no generate)
    "informer": ({**_S2S, **_TS, "attention_type": "full"}, False),  # full attention, not ProbSparse
    "distilbert": ({"dim": 64, "n_heads": 4, "n_layers": 2, "hidden_dim": 128}, False),
    "deepseek_v3": ({**DEEPSEEK, "rope_interleave": True}, True),
    "deepseek_v2": (DEEPSEEK, True),  # always interleaved RoPE
    # ---- copies and near-copies of the classes above (hf_registry._COPIES) ----
    "arcee": ({}, True),
    "phimoe": ({"num_local_experts": 4, "num_experts_per_tok": 2}, True),  # config.sliding_window=6
    "granitemoe": ({"attention_multiplier": 0.3, "num_local_experts": 4, "num_experts_per_tok": 2}, True),
    "qwen3_moe": ({"head_dim": 16, "use_sliding_window": True, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32}, True),
    "seed_oss": ({"head_dim": 16, "attention_bias": True, "attention_out_bias": False}, True),
    "apertus": ({}, True),
    "ernie4_5": ({"head_dim": 16, "use_bias": True}, True),
    "olmo3": ({"layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}}}, True),
    # layer 0 with RoPE, no window; layer 1 without RoPE, sliding
    "smollm3": ({"no_rope_layers": [1, 0], "use_sliding_window": True}, True),
    # chunks of 4 in layer 0 (RoPE, q/k L2 norm), temperature tuning in layer 1 (no RoPE): LLAMA4 above
    "llama4_text": (LLAMA4, True),
    "cohere2": ({"layer_types": ["sliding_attention", "full_attention"]}, True),
    # partial rotary: 10 of D=16 dims rotate (Phi, StableLM rotate-half; GLM interleaved pairs)
    "phi": ({"num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.625}}, True),
    "stablelm": ({"use_qkv_bias": True, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.625}}, True),
    "glm": ({"head_dim": 16, "attention_bias": True, "partial_rotary_factor": 0.625}, True),
    "glm4": ({"head_dim": 16, "attention_bias": True, "partial_rotary_factor": 0.625}, True),
    # verbatim copies of verified classes (their model's MoE small)
    "jais2": ({}, True),
    "granitemoeshared": ({"attention_multiplier": 0.3, "num_local_experts": 4, "num_experts_per_tok": 2,
                          "shared_intermediate_size": 32}, True),
    "hyperclovax": ({"attention_multiplier": 0.3}, True),
    "dots1": ({"head_dim": 16, "layer_types": ["full_attention", "sliding_attention"], "n_routed_experts": 4,
               "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
               "topk_group": 1, "n_shared_experts": 1}, True),
    "flex_olmo": ({"num_experts": 4, "num_experts_per_tok": 2}, True),
    "ernie4_5_moe": ({"head_dim": 16, "use_bias": True, "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32,
                      "moe_num_shared_experts": 1}, True),
    "hy_v3": ({"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}, True),
    # ---- copies of verified classes described by their original's entry (hf_copies.COPIES) ----
    "deit": ({}, False), "vit_mae": ({"mask_ratio": 0.5}, False), "vit_msn": ({}, False), "ijepa": ({}, False),
    "pixio": ({}, False), "dinov2": ({}, False), "dinov2_with_registers": ({"num_register_tokens": 2}, False),
    "vivit": ({"num_frames": 4, "tubelet_size": [2, 8, 8]}, False),
    "audio-spectrogram-transformer": ({"num_mel_bins": 16, "max_length": 32, "frequency_stride": 8,
                                       "time_stride": 8}, False),
    "camembert": ({}, False), "data2vec-text": ({}, False), "ernie": ({}, False), "roc_bert": ({}, False),
    "bert-generation": ({}, False),
    "metaclip_2_text_model": ({}, False), "metaclip_2_vision_model": ({}, False),
    "clipseg_text_model": ({}, False), "clipseg_vision_model": ({}, False),
    "siglip2_text_model": ({}, False), "siglip2_vision_model": ({"num_patches": 16}, False),
    "aria_text": ({"moe_num_experts": 4, "moe_topk": 2, "moe_intermediate_size": 32}, True),
    "cosmos3_edge_text": ({"head_dim": 16, "rope_parameters": QWEN3_VL_ROPE}, False),  # Qwen3-VL's M-RoPE
    "granite_docling_text": ({"attention_multiplier": 0.3}, False),
    "apertus1p5_text": ({}, True),
    # near copies (hf_copies.COPIES, the lines that differ named there)
    "eurobert": ({}, False),  # Llama's, bidirectional
    "vaultgemma": ({"head_dim": 16, "query_pre_attn_scalar": 12, "attn_logit_softcapping": 3.0,
                    "layer_types": ["sliding_attention", "full_attention"]}, True),
    # sliding layer 0 (its own RoPE base), full layer 1
    "mellum": ({"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"], "num_local_experts": 4,
                "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_layer_types": ["sparse", "sparse"],
                "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}, True),
    "chinese_clip_vision_model": ({}, False), "git_vision_model": ({}, False),
    "idefics3_vision": ({}, False), "smolvlm_vision": ({}, False),
    "solar_open": ({"head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}, True),
    "helium": ({"head_dim": 16}, True),
    "cwm": ({"head_dim": 16, "layer_types": ["full_attention", "sliding_attention"]}, True),
    # hand-described near copies (hf_registry._COPIES): RoPE and windows by their own rules
    "exaone4": ({"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"]}, True),
    "exaone_moe": ({"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"], "num_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_layer_types": ["dense", "sparse"],
                    "first_k_dense_replace": 1}, True),
    # layer 0 global but dense (force_rope: RoPE), layer 1 sliding, layer 2 global without RoPE
    "cohere2_moe": ({"head_dim": 16, "num_hidden_layers": 3, "num_experts": 4,
                     "layer_types": ["full_attention", "sliding_attention", "full_attention"],
                     "mlp_layer_types": ["dense", "sparse", "sparse"]}, True),
    # speech encoders with Wav2Vec2's attention: 1600 samples -> 4 frames (the conv stack), padded
    **{t: ({"conv_dim": [32] * 7, "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4,
            "feat_extract_norm": "layer", "do_stable_layer_norm": True}, False)
       for t in ("wav2vec2", "hubert", "unispeech", "unispeech-sat", "data2vec-audio")},
    "sew": ({"conv_dim": [32] * 13, "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4,
             "squeeze_factor": 1}, False),
    "patchtst": ({"d_model": 64, "num_attention_heads": 4, "context_length": 32, "patch_length": 8, "patch_stride": 8,
                  "num_input_channels": 2}, False),
    "audioflamingo3_encoder": ({"num_mel_bins": 8, "max_source_positions": 16, "d_model": 64, "encoder_layers": 2,
                                "encoder_attention_heads": 4, "encoder_ffn_dim": 128}, False),
    "omniasr_audio": ({"conv_dim": [32] * 7, "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4},
                      False),
    "tipsv2_vision_model": ({}, False), "granite_docling_vision": ({}, False),
    "glm4_moe": ({"head_dim": 16, "partial_rotary_factor": 0.625, "n_routed_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}, True),
    "sarvam_moe": ({"head_dim": 16, "partial_rotary_factor": 0.625, "use_qk_norm": False, "num_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
                    "topk_group": 1}, True),
    "sarvam_mla": ({**DEEPSEEK, "rope_interleave": True}, True),
    "persimmon": ({"rope_parameters": {"rope_type": "default", "rope_theta": 25000.0, "partial_rotary_factor": 0.625},
                   "qk_layernorm": False}, True),  # D = 16: 10 dims rotate
    # its forward takes no use_cache: its GPT-2 would cache by the config's
    # local layer 0 (a window of |i - j| <= 2, its own RoPE base), global layer 1
    "modernbert": ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "default", "rope_theta": 160000.0}}}, False),
    # LayoutLM's encoder-only BERT attention and its copies
    "layoutlm": ({}, False), "splinter": ({}, False), "align_text_model": ({}, False),
    "chinese_clip_text_model": ({}, False), "altclip_text_model": ({}, False), "altclip_vision_model": ({}, False),
    "decision_transformer": ({"state_dim": 5, "act_dim": 3, "max_ep_len": 16, "use_cache": False}, False),
    "glm4_moe_lite": ({**DEEPSEEK, "rope_interleave": True, "n_shared_experts": 1}, True),
    # q/k RMSNorm over D after RoPE (qk_norm="head_after_rope"), biases on all four projections
    # and its checkpoints' NTK-alpha RoPE (rope_type "dynamic" with an alpha: a fixed, stretched base)
    "hunyuan_v1_dense": ({"head_dim": 16, "attention_bias": True, "rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 50.0, "factor": 1.0}}, True),
    "youtu": ({**DEEPSEEK, "rope_interleave": True}, True),
    # M-RoPE (3 position rows; text batches here, image rows in tests/interop/test_qwen_vl.py), sliding layer 1
    **{t: ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True}, False)
       for t in ("qwen2_vl_text", "qwen2_5_vl_text")},
    # interleaved M-RoPE and per-head q/k RMSNorm (its MoE model's layers sparse)
    "qwen3_vl_text": ({"head_dim": 16, "rope_parameters": QWEN3_VL_ROPE}, False),
    "qwen3_vl_moe_text": ({"head_dim": 16, "rope_parameters": QWEN3_VL_ROPE, "num_experts": 4,
                           "num_experts_per_tok": 2, "moe_intermediate_size": 32}, False),
}
#: Encoder-decoders: built for generation (``AutoModelForSeq2SeqLM``, Whisper's speech class),
#: their encoder's and decoder's outputs compared, the decoder's cross-attention included.
SEQ2SEQ = {"bart", "mbart", "whisper", "pegasus", "marian", "plbart", "m2m_100", "blenderbot", "blenderbot-small",
           "nllb-moe", "speech_to_text"}
VISION = {"vit", "clip_vision_model", "siglip_vision_model", "deit", "vit_mae", "vit_msn", "ijepa", "pixio", "dinov2",
          "dinov2_with_registers", "metaclip_2_vision_model", "clipseg_vision_model", "chinese_clip_vision_model",
          "git_vision_model", "idefics3_vision", "smolvlm_vision", "tipsv2_vision_model",
          "granite_docling_vision", "altclip_vision_model"}
TIME_SERIES = {"time_series_transformer", "informer"}
#: Language models with an image tower, compared with an image in each row: how many tokens an image
#: of 32 × 32 pixels (16 patches) gives.
#: Gemma 3 with an image: 4 × 4 patches pooled to 2 × 2 tokens (the image token's id 90).
GEMMA3_IMAGE = {"image_token_id": 90, "mm_tokens_per_image": 4}
IMAGE_TOKENS = {"llava": 16, "vipllava": 16, "paligemma": 16, "deepseek_vl": 16, "gemma3": 4, "cohere2_vision": 4}
#: Dual encoders (a text tower and an image tower, run together): padded token ids and two 32 × 32 images.
DUAL_ENCODERS = {"align", "altclip", "chinese_clip", "clip", "clipseg", "metaclip_2", "siglip", "siglip2",
                 "vision-text-dual-encoder", "owlv2", "owlvit", "tipsv2"}
#: Decoders compared by their hidden states (no causal-LM class): their forward caches by default.
DECODER_STATES = {"cosmos3_edge_text", "granite_docling_text", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text",
                  "qwen3_vl_moe_text"}
#: Speech encoders on raw samples: every frame compared (a padded frame still attends to real ones).
AUDIO = {"wav2vec2", "hubert", "sew", "unispeech", "unispeech-sat", "data2vec-audio"}
#: Model types AutoModel does not map: built with their own class.
OWN_CLASS = {"siglip_text_model": "SiglipTextModel", "omniasr_audio": "OmniASRAudioModel",
             "metaclip_2_text_model": "MetaClip2TextModel",
             "metaclip_2_vision_model": "MetaClip2VisionModel", "clipseg_text_model": "CLIPSegTextModel",
             "clipseg_vision_model": "CLIPSegVisionModel", "siglip2_text_model": "Siglip2TextModel",
             "git_vision_model": "GitVisionModel", "align_text_model": "AlignTextModel",
             "chinese_clip_text_model": "ChineseCLIPTextModel", "altclip_text_model": "AltCLIPTextModel",
             "altclip_vision_model": "AltCLIPVisionModel"}


def build(model_type: str, config: Any, auto: Any, impl: str | None = None) -> nn.Module:
    """``auto.from_config(config)``, or the model type's own class where AutoModel lacks it."""
    kw = {} if impl is None else {"attn_implementation": impl}
    if model_type in OWN_CLASS:
        import transformers
        return getattr(transformers, OWN_CLASS[model_type])._from_config(config, **kw)
    return auto.from_config(config, **kw)


def sharpen(model: nn.Module) -> nn.Module:
    """Multiply every 2-D weight by 4 in place (attention far from uniform); returns ``model``."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4)
    return model


#: Types whose attention's q/k norm weights are spread away from ones: a norm whose weight is all
#: ones commutes with RoPE, so its place (before or after the rotation) would not show.
NORMS_SPREAD = {"hunyuan_v1_dense"}


def spread_attention_norms(model: nn.Module) -> None:
    """Set every 1-D parameter inside an attention (``self_attn``) to values in [0.5, 1.5), seeded."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".self_attn." in name and p.dim() == 1 and "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def tiny_config(model_type: str, **extra: Any) -> Any:
    """The model type's config class at tiny sizes (only fields the class has)."""
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    fields = {k: v for k, v in {**TINY, **extra}.items() if hasattr(default, k) or k in extra}
    return cls(**fields)


def _build(model_type: str, spec_override: Any = None) -> tuple[nn.Module, bool]:
    extra, generator = ZOO[model_type]
    torch.random.default_generator.manual_seed(0)
    auto = _seq2seq_auto(model_type) if model_type in SEQ2SEQ else AutoModelForCausalLM if generator else AutoModel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(model_type, tiny_config(model_type, **extra), auto, "eager").eval()
    sharpen(model)
    if model_type in NORMS_SPREAD:
        spread_attention_norms(model)
    return model, generator


def _inputs(model_type: str, side: str = "right") -> dict[str, torch.Tensor]:
    """A batch of two where the second row has 3 padding tokens on ``side``."""
    g = torch.Generator().manual_seed(1)
    if model_type in VISION:
        inputs = {"pixel_values": torch.randn(B, 3, 32, 32, generator=g)}
        if model_type == "vit_mae":  # the noise that picks the masked patches, fixed
            inputs["noise"] = torch.rand(B, 16, generator=g)
        return inputs
    if model_type == "siglip2_vision_model":  # 16 patches of 3 × 8 × 8 values as a 4 × 4 grid, some padding
        return {"pixel_values": torch.randn(B, 16, 192, generator=g), "pixel_attention_mask": _padding_mask(16, side),
                "spatial_shapes": torch.tensor([[4, 4], [4, 4]])}
    if model_type == "vivit":  # (B, frames, C, H, W): 2 tubelets of 4 patches
        return {"pixel_values": torch.randn(B, 4, 3, 32, 32, generator=g)}
    if model_type in AUDIO:  # raw samples, the second row's last (right) or first (left) quarter padding
        return {"input_values": torch.randn(B, 1600, generator=g), "attention_mask": _padding_mask(1600, side, 400)}
    if model_type in ("omniasr_audio", "omniasr_ctc"):  # raw samples (B, 1, T), their padding mask (True: real)
        return {"input_values": torch.randn(B, 1, 1600, generator=g),
                "padding_mask": _padding_mask(1600, side, 400).bool()}
    if model_type == "patchtst":  # (B, context, channels): 4 patches a channel, no padding
        return {"past_values": torch.randn(B, 32, 2, generator=g)}
    if model_type == "audioflamingo3_encoder":  # log-mel features (B, num_mel_bins, 2 · max_source_positions), padded
        return {"input_features": torch.randn(B, 8, 32, generator=g), "input_features_mask": _padding_mask(32, side, 8)}
    if model_type == "decision_transformer":  # trajectories of S steps; the model interleaves 3 tokens a step
        return {"states": torch.randn(B, S, 5, generator=g), "actions": torch.randn(B, S, 3, generator=g),
                "rewards": torch.randn(B, S, 1, generator=g), "returns_to_go": torch.randn(B, S, 1, generator=g),
                "timesteps": torch.arange(S).expand(B, S), "attention_mask": _padding_mask(S, side)}
    if model_type == "audio-spectrogram-transformer":  # (B, time, mel bins): 3 × 1 patches
        return {"input_values": torch.randn(B, 32, 16, generator=g)}
    if model_type in TIME_SERIES:  # past values (8 = 6 + the largest lag), 3 unobserved on ``side``; no attention mask
        past = ZOO[model_type][0]["context_length"] + 2
        observed = _padding_mask(past, side).float()
        return {"past_values": torch.randn(B, past, generator=g),
                "past_time_features": torch.randn(B, past, 1, generator=g),
                "past_observed_mask": observed, "future_values": torch.randn(B, 4, generator=g),
                "future_time_features": torch.randn(B, 4, 1, generator=g)}
    mask = _padding_mask(S, side)
    inputs = {"input_ids": torch.randint(3, VOCAB, (B, S), generator=g), "attention_mask": mask}
    if model_type == "whisper":  # log-mel features: (B, num_mel_bins, 2 · max_source_positions), no padding
        inputs = {"input_features": torch.randn(B, 8, 32, generator=g)}
    if model_type == "speech_to_text":  # (B, 4·S frames, 8 features), 4× fewer after its two stride-2 convolutions
        inputs = {"input_features": torch.randn(B, 4 * S, 8, generator=g),
                  "attention_mask": _padding_mask(4 * S, side, 12)}
    if model_type in IMAGE_TOKENS:  # an image's tokens (id 90) among 5 text tokens in each row, and the two images
        body = [5, 6, *[90] * IMAGE_TOKENS[model_type], 7, 8]
        ids = torch.tensor([body + [9, 10, 11], [0] * 3 + body if side == "left" else body + [0] * 3])
        inputs = {"input_ids": ids, "attention_mask": _padding_mask(ids.shape[1], side), **_inputs("vit", side)}
        if model_type == "gemma3":  # its image tokens attend to each other both ways
            inputs["token_type_ids"] = (ids == 90).long()
    if model_type in DUAL_ENCODERS:  # and the image tower's batch (SigLIP 2's: padded patches)
        inputs.update(_inputs("siglip2_vision_model" if model_type == "siglip2" else "vit", side))
    if model_type in SEQ2SEQ:  # the decoder's own padded batch (S - 2 tokens)
        inputs.update(decoder_input_ids=torch.randint(3, VOCAB, (B, S - 2), generator=g),
                      decoder_attention_mask=_padding_mask(S - 2, side))
    return inputs


def _padding_mask(length: int, side: str, pad: int = 3) -> torch.Tensor:
    """(B, length): the second row has ``pad`` padding tokens on ``side``."""
    mask = torch.ones(B, length, dtype=torch.long)
    mask[1, length - pad:] = 0 if side == "right" else 1
    mask[1, :pad] = 0 if side == "left" else 1
    return mask


def _outs(model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
    """The outputs to compare, each with the index of its real tokens (``...``: all)."""
    with torch.no_grad():
        out = model(**inputs)
    if getattr(out, "encoder_last_hidden_state", None) is not None:  # decoder logits, encoder states
        tokens = "attention_mask" in inputs and "input_features" not in inputs  # (speech frames are subsampled)
        if "past_values" in inputs:  # time series: the decoder's states
            return [(out.last_hidden_state, ...), (out.encoder_last_hidden_state, ...)]
        return [(out.logits, inputs["decoder_attention_mask"].bool()),
                (out.encoder_last_hidden_state, inputs["attention_mask"].bool() if tokens else ...)]
    if getattr(out, "text_model_output", None) is not None:  # a dual encoder: each tower's states
        return [(out.text_model_output.last_hidden_state, inputs["attention_mask"].bool()),
                (out.vision_model_output.last_hidden_state, ...)]
    for name in ("logits", "last_hidden_state", "pooler_output", "latents"):  # (latents: an audio tokenizer's)
        if getattr(out, name, None) is not None:
            want = out[name]
            real = (inputs["attention_mask"].bool() if want.dim() == 3 and "attention_mask" in inputs
                    and not {"input_values", "input_features"} & set(inputs) else ...)  # (audio: frames subsampled)
            frames = getattr(out, "attention_mask", None)  # an audio encoder's real frames after subsampling
            if isinstance(frames, torch.Tensor) and frames.shape == want.shape[:2]:
                real = frames.bool()
            if "returns_to_go" in inputs:  # DecisionTransformer: (return, state, action) tokens per step
                real = inputs["attention_mask"].bool().repeat_interleave(3, dim=1)
            return [(want, real)]
    raise AssertionError(f"no output to compare in {type(out).__name__}")


def _seq2seq_auto(model_type: str) -> Any:
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq
    return AutoModelForSpeechSeq2Seq if model_type in ("whisper", "speech_to_text") else AutoModelForSeq2SeqLM


def _generate(model: nn.Module, model_type: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Greedy tokens (4 new ones at least) from the first row of ``batch``."""
    greedy = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    if model_type == "whisper":  # the plain generation loop (Whisper's own wants a real generation config)
        from transformers import GenerationMixin
        return GenerationMixin.generate(model, input_features=batch["input_features"][:1],
                                        decoder_input_ids=torch.full((1, 1), 2), **greedy)
    if "input_features" in batch:  # Speech2Text
        return model.generate(input_features=batch["input_features"][:1], **greedy)
    return model.generate(batch["input_ids"][:1], **greedy)


def compare(model_type: str) -> str:
    """``"exact"``, or what differs (``"wrong: ..."``) after patching ``model_type``'s tiny model."""
    model, generator = _build(model_type)
    # the registered wrappers only (the kernel route: test_kernel_zoo.py)
    return compare_patched(model, model_type, generator, lambda m: mh.hf.patch(m, kernel=False))


def compare_patched(model: nn.Module, model_type: str, generator: bool, patching: Any,
                    inputs: Any = None) -> str:
    """``"exact"``, or what differs, between ``model`` (eager) and ``model`` after ``patching(model)``:
    right- and left-padded batches (relative 1e-5 on real tokens, or where more, within the accuracy
    criterion against the unpatched model in float64: :func:`_within_criterion`), and greedy tokens
    for generators. ``inputs(model_type, side)`` makes a batch (default :func:`_inputs`)."""
    batches = [(inputs or _inputs)(model_type, side) for side in ("right", "left")]
    wants = [_outs(model, inputs) for inputs in batches]
    tokens = _generate(model, model_type, batches[0]) if generator else None
    oracle = _unpatched_copy(model)
    patching(model)
    for side, inputs, want in zip(("right", "left"), batches, wants):
        for index, ((got, _), (out, real)) in enumerate(zip(_outs(model, inputs), want)):
            rel = ((got[real] - out[real]).abs().max() / out[real].abs().max()).item()
            if not (rel <= RTOL or _within_criterion(oracle, inputs, index, got, out, real)):
                return f"wrong: relative difference {rel:.2e} on real tokens ({side} padding)"
    if generator and not torch.equal(_generate(model, model_type, batches[0]), tokens):
        return "wrong: different greedy tokens"
    return "exact"


def _unpatched_copy(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` before patching, for :func:`_within_criterion` (None where it cannot be copied:
    then the relative 1e-5 alone decides)."""
    try:
        return copy.deepcopy(model)
    except Exception:  # a model holding something deepcopy refuses
        return None


def _within_criterion(oracle: nn.Module | None, inputs: dict[str, torch.Tensor], index: int, got: torch.Tensor,
                      out: torch.Tensor, real: Any) -> bool:
    """Whether the patched output ``got`` (the ``index``-th of :func:`_outs`) meets the accuracy criterion
    where it differs from HF's float32 ``out`` by more than :data:`RTOL`: its error against the unpatched
    model run in float64 on the same inputs at most 2× HF's own float32 error (a float32 model whose
    logits are not scaled down, T5's, differs from itself in float64 by 2.7e-5 relative). False where the
    copy is missing or does not run in float64."""
    if oracle is None:
        return False
    wide = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    try:
        truth = _outs(oracle.double(), wide)[index][0][real]
    except (RuntimeError, TypeError):  # a model hard-wired to float32 somewhere
        return False
    ours, theirs = (got[real].double() - truth).abs().max(), (out[real].double() - truth).abs().max()
    return bool(ours <= 2 * theirs)


@pytest.mark.parametrize("model_type", list(ZOO))
def test_accepted_model_type_is_exact(model_type: str) -> None:
    assert compare(model_type) == "exact"


#: Model types whose every attention module is a registered class of :data:`ZOO`'s types, inside a
#: composite or under another config name: (extra fields, a sub-config's under its name; generator?).
#: Built with every sub-config tiny (:func:`tiny_composite`) and compared whole on the wrapper route:
#: dual encoders on token ids and images (both towers run); the language models with an image tower
#: with an image in each row (:data:`IMAGE_TOKENS`) or, like those with an audio tower, on token ids
#: (their towers run alone as :data:`ZOO`'s ``*_vision_model`` / ``*_encoder`` types); OmniASR's CTC
#: model on raw samples.
COMPOSITES: dict[str, tuple[dict[str, Any], bool]] = {
    "gpt-sw3": ({}, True),  # GPT-2's config and classes
    # dual encoders; ALIGN's image tower is an EfficientNet (no attention), cut to one block of 24 channels
    "align": ({"projection_dim": 24, "vision_config": {
        "width_coefficient": 1.0, "depth_coefficient": 1.0, "hidden_dim": 64, "kernel_sizes": [3], "in_channels": [32],
        "out_channels": [24], "strides": [2], "num_block_repeats": [1], "expand_ratios": [1]}}, False),
    **dict.fromkeys(("altclip", "chinese_clip", "clip", "clipseg", "metaclip_2", "siglip", "vision-text-dual-encoder"),
                    ({}, False)),
    "siglip2": ({"vision_config": {"num_patches": 16}}, False),
    # language models with an image tower: with an image (IMAGE_TOKENS, the image token's id 90), or on text
    **dict.fromkeys(("llava", "deepseek_vl"), ({"image_token_id": 90}, False)),
    "vipllava": ({"image_token_id": 90, "vision_feature_layers": [-2, -1]}, False),
    "paligemma": ({"image_token_id": 90, "projection_dim": 64}, False),
    "cohere2_vision": ({"image_token_id": 90, "alignment_intermediate_size": 128}, False),
    # its image's tokens attend to each other both ways (token_type_ids): HF's mask alone there (hf_structure)
    "gemma3": (GEMMA3_IMAGE, False),
    **dict.fromkeys(("idefics3", "llava_next", "llava_next_video", "llava_onevision", "modernvbert", "smolvlm",
                     "video_llava"), ({}, False)),
    "granite_docling": ({"vision_config": {"out_hidden_size": 64}}, False),  # its tower's width is the text's
    # language models with an audio tower, and an audio encoder's CTC head
    **dict.fromkeys(("audioflamingo3", "musicflamingo", "omniasr", "omniasr_ctc"), ({}, False)),
}
#: The other types whose attention modules are all registered classes, each with why it is not compared
#: (the meta pass requires every wrapper-route type to be in :data:`ZOO`, :data:`COMPOSITES` or here).
COMPOSITES_UNCOMPARED = {
    "pi0": "needs inputs of its own: action_embeds with the images and text of its PaliGemma",
    "vibevoice": "not tiny: 1031M parameters with every sub-config at the tiny sizes (its diffusion head and "
                 "acoustic tokenizer left at their defaults)",
    "vibevoice_asr": "not tiny: 687M parameters with every sub-config at the tiny sizes (its acoustic and semantic "
                     "tokenizers left at their defaults)",
}


def tiny_composite(cls: Any, extra: dict[str, Any]) -> Any:
    """Config class ``cls`` at the tiny sizes, each sub-config too, a backbone typed ``AutoConfig``
    included (its default's own class), with :data:`ZOO`'s fields for the sub-config's model type;
    ``extra[name]`` holds a sub-config's own fields."""
    from transformers import PretrainedConfig

    default = cls()
    subs = getattr(cls, "sub_configs", {})
    fields = {k: v for k, v in {**TINY, **extra}.items() if (hasattr(default, k) or k in extra) and k not in subs}
    for name in subs:
        sub = getattr(default, name, None)
        if isinstance(sub, PretrainedConfig):
            fields[name] = tiny_composite(type(sub), {**ZOO.get(sub.model_type, ({}, False))[0], **extra.get(name, {})})
    return cls(**fields)


def compare_composite(model_type: str, extra: dict[str, Any] | None = None, inputs: Any = None) -> str:
    """``"exact"`` or what differs after ``mh.hf.patch`` (registered wrappers only) in :data:`COMPOSITES`'
    tiny model of ``model_type`` (or one with ``extra`` fields, not a generator), on :func:`_inputs`' batches
    (or ``inputs(model_type, side)``'s); a patched module must run on them."""
    extra, generator = COMPOSITES[model_type] if extra is None else (extra, False)
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = tiny_composite(CONFIG_MAPPING[model_type], extra)
        model = build(model_type, config, AutoModelForCausalLM if generator else AutoModel, "eager").eval()
    assert sum(p.numel() for p in model.parameters()) < 2_000_000  # tiny
    sharpen(model)
    patched: set[str] = set()
    ran: set[str] = set()

    def patching(m: nn.Module) -> None:
        for r in mh.hf.patch(m, kernel=False, report=True):
            patched.add(r.name)
            m.get_submodule(r.name).register_forward_hook(lambda *_, name=r.name: ran.add(name))

    found = compare_patched(model, model_type, generator, patching, inputs)
    assert ran, f"{model_type}: no patched module ran on its inputs"
    if inputs is None and model_type in {*IMAGE_TOKENS, *DUAL_ENCODERS}:  # the towers too
        assert ran == patched, f"{model_type}: {sorted(patched - ran)} did not run"
    return found


@pytest.mark.parametrize("model_type", list(COMPOSITES))
def test_composite_of_accepted_classes_is_exact(model_type: str) -> None:
    assert compare_composite(model_type) == "exact"


def test_gemma3_with_an_image_is_exact_with_and_without_token_types() -> None:
    """Gemma 3's mask with ``token_type_ids`` lets an image's tokens attend to each other both ways (the
    wrappers attend with HF's mask alone there: multihead.interop.hf_structure); without them, causally."""
    assert compare_composite("gemma3") == "exact"
    assert compare_composite("gemma3", GEMMA3_IMAGE, lambda model_type, side: {
        k: v for k, v in _inputs(model_type, side).items() if k != "token_type_ids"}) == "exact"


def test_the_layers_causal_rule_on_top_of_gemma3s_image_mask_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the wrappers' old reading, the layer's causal rule and-ed with HF's mask, removes the
    image's forward links; the comparison reports it."""
    monkeypatch.setattr(hf_wrappers, "attend_structure", lambda structure, *_: structure)
    assert compare_composite("gemma3").startswith("wrong")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_gemma3_greedy_tokens_with_an_image_equal_unpatched(impl: str) -> None:
    """``generate`` with an image and ``token_type_ids`` on HF's DynamicCache and on KVCacheAdapter:
    the unpatched model's tokens, which differ from those of the image attended causally. After the
    image's prefill the adapter's layers take the fused step (where the kernel runs here): a text
    token decoded after the image is plain causal, HF's mask for it none (SDPA) or the layer's own
    rule (eager: all keys, or the sliding layer's window)."""
    from transformers import AutoModelForCausalLM

    extra = {**GEMMA3_IMAGE, "text_config": {"num_hidden_layers": 4,  # deep enough for the image to choose tokens
                                             "layer_types": ["sliding_attention", "full_attention"] * 2}}
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("gemma3", tiny_composite(CONFIG_MAPPING["gemma3"], extra), AutoModelForCausalLM, impl).eval()
    sharpen(model)
    ids = torch.tensor([[27, 54, *[90] * 4, 47, 78, 38, 24, 21]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": (ids == 90).long(),
             "pixel_values": _inputs("vit")["pixel_values"][:1]}
    greedy = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = model.generate(**batch, **greedy)
        causal = model.generate(**{k: v for k, v in batch.items() if k != "token_type_ids"}, **greedy)
        mh.hf.patch(model, kernel=False)
        got = model.generate(**batch, **greedy)
        adapter = mh.hf.KVCacheAdapter(model, max_len=ids.shape[1] + 8)
        got_adapter = model.generate(**batch, **greedy, cache=adapter)
    assert not torch.equal(causal, want)  # the image's tokens attending both ways choose other tokens
    assert torch.equal(got, want)
    assert torch.equal(got_adapter, want)
    assert ("fused" in adapter.paths) == (native.vector_bits() >= 256), adapter.paths


def _modeling_modules(model_type: str) -> list[Any]:
    """The modeling modules of ``model_type``'s package (data2vec has three, donut one named donut_swin)."""
    name = model_type_to_module_name(model_type)
    try:
        package = importlib.import_module(f"transformers.models.{name}")
    except ImportError:
        return []
    names = [m.name for m in pkgutil.iter_modules(package.__path__) if m.name.startswith("modeling_")
             and not m.name.startswith(("modeling_tf_", "modeling_flax_"))]
    modules = []
    for n in names:
        try:
            modules.append(importlib.import_module(f"{package.__name__}.{n}"))
        except ImportError:  # an optional dependency (torchaudio) is missing: listed as unimportable
            pass
    return modules


def test_every_registered_class_is_in_the_zoo() -> None:
    covered = {t for spec in hf_registry.REGISTRY.values() for t in spec.model_types}
    assert covered == set(ZOO)


def _may_hold_registered(modules: list[Any]) -> bool:
    """Whether a model of these modeling modules could contain a registered class: it holds
    one, or reaches into another model package (its classes, its module, or an Auto class)."""
    if not modules:
        return True  # no modeling module of its own: its config maps to another package's models
    own = {m.__name__.rpartition(".")[0] for m in modules}
    for module in modules:
        for value in vars(module).values():
            where = getattr(value, "__module__", None) if isinstance(value, type) else getattr(value, "__name__", None)
            if not isinstance(where, str):
                continue
            if where.startswith("transformers.models.") and where.rpartition(".")[0] not in own:
                return True  # another model's class or module, or transformers.models.auto
            if isinstance(value, type) and f"{value.__module__}.{value.__qualname__}" in hf_registry.REGISTRY:
                return True
    return False


#: Hybrid models whose first two layers hold no attention (state-space, linear or recurrent layers
#: first): the meta pass builds them with 8 layers, so that their attention modules are there.
HYBRIDS = dict.fromkeys(("jamba", "lfm3", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "recurrent_gemma"),
                        {"num_hidden_layers": 8})


def _patch_on_meta(model_type: str) -> str:
    """The routes ``mh.hf.patch`` takes in ``model_type``'s model (``"wrapper"``, ``"kernel"`` or
    ``"wrapper+kernel"``), ``"refused"``, ``"no attention"`` or ``"unbuildable"``; anything else raises."""
    from transformers.initialization import no_init_weights

    try:  # on meta, with no weight initialised (there are no values to initialise): the model's modules only
        with warnings.catch_warnings(), torch.device("meta"), no_init_weights():
            warnings.simplefilter("ignore")
            extra = {**HYBRIDS.get(model_type, {}), **ZOO.get(model_type, ({}, False))[0]}
            model = build(model_type, tiny_config(model_type, **extra), AutoModel)
    except Exception:  # noqa: BLE001 - a config the tiny recipe cannot build is not our failure
        return "unbuildable"
    try:
        routes = mh.hf.patch(model, report=True)
    except ValueError as e:
        return "refused" if "cannot patch" in str(e) else "no attention"
    for m in model.modules():
        if isinstance(m, mh.hf.PatchedAttention):
            config = hf_registry._config_of(m.original)
            if config is None:  # the module holds every fact (BLOOM): its class is verified in the zoo
                assert hf_registry.require_spec(m.original).config_free
                continue
            assert config.model_type in ZOO, f"{model_type}: patched {type(m.original).__name__} with a " \
                                             f"{config.model_type} config"
    return "+".join(sorted({r.route for r in routes}, reverse=True))


#: The counts of :func:`test_every_model_type_is_exact_or_refused` as the HF guide states them, for the
#: transformers version it names (tests/docs compares the guide's other claims).
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "huggingface.md"


def routes_sentence(outcome: dict[str, list[str]], total: int) -> str:
    """The guide's sentence on how many model types take each route."""
    import transformers as tf

    kernel = outcome.get("kernel", []) + outcome.get("wrapper+kernel", [])
    return (f"Of the {total} model types of transformers {tf.__version__}, `mh.hf.patch` runs "
            f"{len(outcome.get('wrapper', [])) + len(outcome.get('wrapper+kernel', []))} with registered wrappers "
            f"and {len(kernel)} through the kernel route ({len(outcome.get('wrapper+kernel', []))} of them "
            f"with both), refuses {len(outcome.get('refused', []))} by name and finds no attention module in "
            f"{len(outcome.get('no attention', []))}; {len(outcome.get('unbuildable', []))} cannot be built "
            "from a tiny config without inputs of their own.")


def test_every_model_type_is_exact_or_refused(capsys: pytest.CaptureFixture) -> None:
    """All model types: patched only where a verified (class, config type) pair is inside or the
    kernel route takes the module, refused by name otherwise, never another exception; the
    guide's counts are these."""
    from test_kernel_zoo import KERNEL_ZOO

    outcome: dict[str, list[str]] = {}
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        modules = _modeling_modules(model_type)
        kind = _patch_on_meta(model_type) if _may_hold_registered(modules) or any(
            _dispatches_in(m) for m in modules) else "refused"
        outcome.setdefault(kind, []).append(model_type)
    with capsys.disabled():
        print(f"\nzoo: {len(CONFIG_MAPPING_NAMES)} model types: "
              + ", ".join(f"{len(v)} {k}" for k, v in sorted(outcome.items())))
    assert len(CONFIG_MAPPING_NAMES) > 800  # the whole zoo was enumerated
    wrapped = set(outcome.get("wrapper", [])) | set(outcome.get("wrapper+kernel", []))
    assert set(ZOO) <= wrapped  # every verified type is found and patched with its wrappers
    # every other wrapper-route type (a composite of verified classes) compared, or listed with why
    assert set(outcome.get("wrapper", [])) - set(ZOO) == set(COMPOSITES) | set(COMPOSITES_UNCOMPARED)
    assert set(KERNEL_ZOO) <= set(outcome.get("kernel", []))  # every kernel-route type compared is found so
    guide = GUIDE.read_text(encoding="utf-8")
    start, end = "<!-- zoo-routes -->\n", "\n<!-- /zoo-routes -->"
    stated = guide[guide.index(start) + len(start):guide.index(end)]
    import transformers as tf

    if f"transformers {tf.__version__}," in stated:  # the guide and README state the pinned version's counts
        assert stated == routes_sentence(outcome, len(CONFIG_MAPPING_NAMES))
        from test_kernel_zoo import NESTED_ZOO, UNCOMPARED  # every kernel-route type compared, or listed with why
        compared = set(KERNEL_ZOO) | set(NESTED_ZOO)
        assert not compared & set(UNCOMPARED)
        assert compared | set(UNCOMPARED) == set(outcome.get("kernel", [])) | set(outcome.get("wrapper+kernel", []))
        readme = " ".join((GUIDE.parents[2] / "README.md").read_text(encoding="utf-8").split())
        wrapped, kernel = len(wrapped), len(outcome.get("kernel", [])) + len(outcome.get("wrapper+kernel", []))
        assert (f"Of transformers {tf.__version__.rsplit('.', 1)[0]}'s {len(CONFIG_MAPPING_NAMES)} model types, "
                f"{wrapped} patch with wrappers and {kernel} through the kernel") in readme


def test_guide_states_how_many_model_types_are_compared_exact() -> None:
    """The HF guide's counts of the model types compared exact after ``mh.hf.patch`` are the zoo's lists:
    :data:`ZOO`, :data:`COMPOSITES` and test_kernel_zoo.py's kernel-route types, each type counted once."""
    from test_kernel_zoo import KERNEL_ZOO, NESTED_ZOO, UNCOMPARED

    kernel = set(KERNEL_ZOO) | set(NESTED_ZOO)
    compared = set(ZOO) | set(COMPOSITES) | kernel
    guide = " ".join(GUIDE.read_text(encoding="utf-8").split())
    assert f"The kernel route is compared on {len(kernel)} model types: the {len(KERNEL_ZOO)} " in guide
    assert f"The other {len(UNCOMPARED)} kernel-route types are listed" in guide
    large = sum(why.startswith("not tiny") for why in UNCOMPARED.values())
    needs = sum(why.startswith("needs inputs of its own") for why in UNCOMPARED.values())
    assert (f"{large} are not tiny even with every sub-config shrunk (a part left at its default), {needs} need "
            f"inputs of their own") in guide
    assert f"and on {len(UNCOMPARED) - large - needs} the tiny config is refused" in guide
    assert (f"{len(compared)} model types are compared exact on the patch route: the {len(ZOO)} of the registered "
            f"classes, {len(COMPOSITES)} composites of them and {len(kernel)} on the kernel route.") in guide


def _dispatches_in(module: Any) -> bool:
    """Whether a modeling module defines a class whose forward dispatches through AttentionInterface."""
    from multihead.interop import hf_routes

    return any(isinstance(v, type) and issubclass(v, nn.Module) and v.__module__ == module.__name__
               and hf_routes.dispatches_class(v) for v in vars(module).values())


def test_zoo_catches_rope_planted_in_vit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison fails when the registry is wrong: ViT described with RoPE (cause 1)."""
    key = "transformers.models.vit.modeling_vit.ViTAttention"
    planted = dataclasses.replace(hf_registry.REGISTRY[key], rope="half")
    monkeypatch.setitem(hf_registry.REGISTRY, key, planted)
    assert compare("vit").startswith("wrong")


def test_docs_table_is_the_registry() -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "huggingface.md").read_text(encoding="utf-8")
    start, end = "<!-- registry-table -->\n", "\n<!-- /registry-table -->"
    table = readme[readme.index(start) + len(start):readme.index(end)]
    assert table == hf_registry.markdown_table()


def _planted(monkeypatch: pytest.MonkeyPatch, cls: str, **wrong: Any) -> None:
    """Replace ``cls``'s registry entry by one with the ``wrong`` fields."""
    monkeypatch.setitem(hf_registry.REGISTRY, cls, dataclasses.replace(hf_registry.REGISTRY[cls], **wrong))


def test_zoo_catches_rope_planted_in_smollm3_no_rope_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM3 described as rotating every layer (its layer 1 has use_rope=0): the comparison fails."""
    _planted(monkeypatch, "transformers.models.smollm3.modeling_smollm3.SmolLM3Attention", rope_on=None)
    assert compare("smollm3").startswith("wrong")


def test_zoo_catches_rotate_half_planted_in_ernie4_5(monkeypatch: pytest.MonkeyPatch) -> None:
    """ERNIE 4.5 described with rotate-half pairing instead of its interleaved pairs: the comparison fails."""
    _planted(monkeypatch, "transformers.models.ernie4_5.modeling_ernie4_5.Ernie4_5Attention", rope="half")
    assert compare("ernie4_5").startswith("wrong")



def test_zoo_catches_rotate_half_planted_in_glm_partial_rotary(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLM described with rotate-half on its partial rotary dims (it pairs (2p, 2p+1)): the comparison fails."""
    _planted(monkeypatch, "transformers.models.glm.modeling_glm.GlmAttention", rope="half")
    assert compare("glm").startswith("wrong")


def test_zoo_refuses_phi_described_without_its_partial_rotary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi described as rotating all of D: its config's partial_rotary_factor is refused, never ignored."""
    _planted(monkeypatch, "transformers.models.phi.modeling_phi.PhiAttention", partial_rotary=False, check=None)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.625 is not supported"):
        compare("phi")


def test_zoo_catches_rope_planted_in_exaone4_global_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """EXAONE 4 described as rotating every layer (its global layer 1 has no RoPE): the comparison fails."""
    _planted(monkeypatch, "transformers.models.exaone4.modeling_exaone4.Exaone4Attention", rope_on=None)
    assert compare("exaone4").startswith("wrong")


def test_zoo_catches_window_planted_in_exaone4_global_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """EXAONE 4 described with module.sliding_window in every layer (it is set in its global layer too,
    but passed to the kernel only where is_sliding): the comparison fails."""
    _planted(monkeypatch, "transformers.models.exaone4.modeling_exaone4.Exaone4Attention", window="module")
    assert compare("exaone4").startswith("wrong")


def test_zoo_catches_cohere2_rule_planted_in_cohere2_moe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cohere 2 MoE described by Cohere 2's RoPE rule (its dense global layer 0 rotates: force_rope)."""
    _planted(monkeypatch, "transformers.models.cohere2_moe.modeling_cohere2_moe.Cohere2MoeAttention",
             rope_on=hf_registry.REGISTRY["transformers.models.cohere2.modeling_cohere2.Cohere2Attention"].rope_on)
    assert compare("cohere2_moe").startswith("wrong")


def test_zoo_catches_interleaved_pairs_planted_in_glm4_moe(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLM-4 MoE described with GLM's interleaved pairs (it rotates its partial dims rotate-half)."""
    _planted(monkeypatch, "transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeAttention", rope="interleaved")
    assert compare("glm4_moe").startswith("wrong")


def test_zoo_catches_a_wrong_rotary_width_planted_in_persimmon(monkeypatch: pytest.MonkeyPatch) -> None:
    """Persimmon described as rotating all of D (it rotates 10 of 16 dims): refused, never ignored;
    and with GLM's interleaved pairs on its partial dims: the comparison fails."""
    key = "transformers.models.persimmon.modeling_persimmon.PersimmonAttention"
    _planted(monkeypatch, key, partial_rotary=False, check=None)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.625 is not supported"):
        compare("persimmon")
    _planted(monkeypatch, key, partial_rotary=True, rope="interleaved")
    assert compare("persimmon").startswith("wrong")


def test_zoo_catches_config_window_planted_in_modernbert(monkeypatch: pytest.MonkeyPatch) -> None:
    """ModernBERT described with config.sliding_window as its window: one key short on each side
    (the module's is config.sliding_window + 1, HF's mask |i - j| <= config.sliding_window)."""
    _planted(monkeypatch, "transformers.models.modernbert.modeling_modernbert.ModernBertAttention", window="config")
    assert compare("modernbert").startswith("wrong")


@pytest.mark.parametrize("model_type", ["modernbert", "mellum"])
def test_zoo_catches_one_rope_base_planted_in_a_config_layer_typed_family(model_type: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """ModernBERT, Mellum described as reading the full layers' RoPE in every layer (their layer 0 has
    base 10000, layer 1 160000 / 500000; each picked by config.layer_types[layer_idx]): the comparison fails."""
    from multihead.interop import hf_config

    real = hf_config.module_rope
    monkeypatch.setattr(hf_config, "module_rope", lambda cfg, kind, src, **kw: real(cfg, "full_attention", src, **kw))
    assert compare(model_type).startswith("wrong")


#: Decoders whose HF cache the patched model fills (latent attention caches in its own pairing:
#: tests/interop/test_deepseek.py compares its bytes).
CACHE_FILLERS = [t for t, (_, generator) in ZOO.items() if generator and t not in SEQ2SEQ
                 and all(spec.layout != "latent" for spec in hf_registry.REGISTRY.values() if t in spec.model_types)]


@pytest.mark.parametrize("model_type", CACHE_FILLERS)
def test_patched_model_fills_hf_cache_as_hf_does(model_type: str) -> None:
    """The prompt's keys and values the patched model writes into HF's cache equal HF's own (left-padded batch,
    real tokens; a sliding layer's cache holds the last keys only)."""
    model, _ = _build(model_type)
    inputs = _inputs(model_type, "left")
    with torch.no_grad():
        want = model(**inputs, use_cache=True).past_key_values
        got = mh.hf.patch(model)(**inputs, use_cache=True).past_key_values
    assert len(got.layers) == len(want.layers) > 0
    for i, (g, w) in enumerate(zip(got.layers, want.layers)):
        for kind in ("keys", "values"):
            a, b = getattr(g, kind), getattr(w, kind)  # (B, Hkv, Sk, D)
            assert a.shape == b.shape, f"layer {i} {kind}: {tuple(a.shape)} != {tuple(b.shape)}"
            real = inputs["attention_mask"][:, -a.shape[2]:].bool()  # (B, Sk)
            a, b = a.transpose(1, 2)[real], b.transpose(1, 2)[real]
            rel = ((a - b).abs().max() / b.abs().max()).item()
            assert rel <= RTOL, f"layer {i} {kind}: relative difference {rel:.2e}"


def test_zoo_catches_qk_norm_before_rope_planted_in_hunyuan_v1_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """HunYuan dense described with its q/k RMSNorm before RoPE (it normalises the rotated q and k)."""
    _planted(monkeypatch, "transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense.HunYuanDenseV1Attention",
             qk_norm="head")
    assert compare("hunyuan_v1_dense").startswith("wrong")


def test_zoo_catches_the_ntk_alpha_base_ignored_in_hunyuan_v1_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """HunYuan dense described without its NTK-alpha base (the config's RoPE read as dynamic NTK instead)."""
    _planted(monkeypatch, "transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense.HunYuanDenseV1Attention",
             rope_theta=None)
    assert compare("hunyuan_v1_dense").startswith("wrong")
