"""The patch's kernel route: model types no registered wrapper takes, patched through transformers'
``AttentionInterface`` (``mh.hf.patch`` keeps HF's module, multihead's kernel computes softmax(QKᵀ)V).

Notation: B batch, S tokens.

Every model type of :data:`KERNEL_ZOO` (the types whose tiny model runs on token ids, holds no
registered class and dispatches through the interface: measured over every model type of
transformers 5.24) is built as test_zoo.py builds its types (E=64, H=4, Hkv=2, 2 layers, every
2-D weight ×4), patched by plain ``mh.hf.patch(model)``, and compared with the eager model on a
right- and a left-padded batch (relative 1e-5 on real tokens) and through greedy generation (the
same tokens). ``mh.hf.routes`` must name the kernel route for each of its attention modules, and
``unpatch`` must give the model its implementation back. A planted kernel that ignores the padding
mask must fail the comparison.

:data:`NESTED_ZOO`'s composite, encoder-decoder, vision and audio types are built with every
sub-config tiny and compared the same way on their own inputs (images, patch grids, log-mel
features); the planted mistakes (a dropped mask, a wrong scale) fail there too. Every other type
on the kernel route is in :data:`UNCOMPARED` with the reason.

Runtime: about 15 s on 2 cores.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.interop import hf_kernel

pytest.importorskip("transformers")
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM  # noqa: E402

from test_zoo import RTOL, TINY, _inputs, _outs, _padding_mask, build, compare_patched, sharpen, tiny_config  # noqa: E402

_MOE = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32}

#: Multi-head latent attention at tiny sizes (its heads equal, small ranks, a small MoE).
_MLA = {"num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8,
        "v_head_dim": 10, "head_dim": 8, "index_head_dim": 16, "index_n_heads": 2, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
        "topk_group": 1}

#: Model types on the kernel route: (extra config fields, generator?). Sizes shrunk where the
#: tiny recipe leaves a large default (experts, state-space widths, per-layer embeddings).
KERNEL_ZOO: dict[str, tuple[dict[str, Any], bool]] = {
    # decoders
    "afmoe": (_MOE, True), "beam": ({}, True), "bitnet": ({}, True), "ctrl": ({}, True), "diffllama": ({}, True),
    "doge": ({}, True), "flint": ({}, True), "gpt_bigcode": ({}, True), "granite_swa": ({}, True),
    "granitemoe_swa": ({}, True), "hrm_text": ({}, True), "jetmoe": (_MOE, True), "laguna": (_MOE, True),
    "lara_mini": (_MOE, True), "lfm2": ({}, True), "minimax_m2": (_MOE, True),
    "ministral3": ({}, True), "modernbert-decoder": ({}, True), "nanochat": ({}, True), "nemotron": ({}, True),
    "olmoe": (_MOE, True), "qwen2_moe": (_MOE, True), "gemma4_unified_text": ({}, True),
    "zaya": ({"num_experts": 4, "moe_intermediate_size": 32}, True),  # (one expert a token only)
    "roberta-prelayernorm": ({}, True), "xlm-roberta-xl": ({}, True),
    "falcon_h1": ({"mamba_d_ssm": 64, "mamba_d_state": 16, "mamba_chunk_size": 16, "mamba_n_heads": 4,
                   "mamba_d_head": 16, "mamba_expand": 1}, True),
    "inkling_text": ({**_MOE, "rel_extent": 16}, True),
    "gemma4_text": ({"vocab_size_per_layer_input": 100, "hidden_size_per_layer_input": 16}, True),
    "nemotron_h": (_MOE, True), "kolibri1": (_MOE, True), "mimo_v2_flash": (_MOE, True),
    # encoders and decoders compared by their states
    "albert": ({}, False), "gte": ({}, False), "higgs_audio_v2": ({}, False), "jina_embeddings_v3": ({}, False),
    "mobilebert": ({}, False), "molmo2_text": ({}, False), "muse_glimmer_text": ({}, False),
    "nomic_bert": ({}, False),
    "tipsv2_text_model": ({}, False), "ultrabert": ({}, False),
    # latent attention (its heads equal), a looped decoder (1 input, 1 recurrent, 1 output layer), M-RoPE
    "axk1": (_MLA, True), "longcat_flash": (_MLA, True),
    "dory": ({"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1,
              "head_dim": 16}, True),
    "glm4v_moe_text": ({**_MOE, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}}, False),
}


#: Registered classes whose description refuses a setting (so no wrapper takes them; the refusals
#: are in test_copied_families.py): the kernel route takes them instead, exact all the same.
FALLBACKS: dict[str, tuple[str, dict[str, Any]]] = {
    "phi q/k LayerNorm": ("phi", {"qk_layernorm": True}),
    "persimmon q/k LayerNorm": ("persimmon", {"qk_layernorm": True}),
    "glm4_moe q/k norm": ("glm4_moe", {"head_dim": 16, "use_qk_norm": True, "n_routed_experts": 4,
                                       "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                                       "moe_intermediate_size": 32}),
    "phimoe longrope with mscale": ("phimoe", {"num_local_experts": 2, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
        "short_mscale": 1.2, "long_mscale": 1.3, "original_max_position_embeddings": 4}}),
}


def _eager(model_type: str, extra: dict[str, Any] | None = None, generator: bool | None = None) -> nn.Module:
    if extra is None or generator is None:
        extra, generator = KERNEL_ZOO[model_type]
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(model_type, tiny_config(model_type, **extra), AutoModelForCausalLM if generator else AutoModel,
                      "eager").eval()
    return sharpen(model)


def compare_kernel_route(model_type: str, extra: dict[str, Any] | None = None, generator: bool | None = None) -> str:
    """``"exact"`` or what differs after ``mh.hf.patch`` puts the kernel in ``model_type``'s tiny model
    (:data:`KERNEL_ZOO`'s settings, or ``extra`` and ``generator``)."""
    model = _eager(model_type, extra, generator)
    generator = KERNEL_ZOO[model_type][1] if generator is None else generator

    def patching(m: nn.Module) -> None:
        report = mh.hf.patch(m, report=True)
        assert report and {r.route for r in report} == {"kernel"}, report

    found = compare_patched(model, model_type, generator, patching)
    mh.hf.unpatch(model)
    assert not mh.hf.is_patched(model) and model.config._attn_implementation == "eager"
    return found


@pytest.mark.parametrize("model_type", list(KERNEL_ZOO))
def test_kernel_route_type_is_exact(model_type: str) -> None:
    assert compare_kernel_route(model_type) == "exact"


#: Qwen3-Next and Qwen3.5-MoE: linear-attention and attention layers in turn, small experts and heads.
_QWEN_NEXT = {"num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
              "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16}
_MROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
#: Small ids for a VL model's image and vision-bracket tokens (its defaults lie past the tiny vocabulary).
_VL_IDS = {"image_token_id": 90, "video_token_id": 91, "vision_start_token_id": 92, "vision_end_token_id": 93}
#: Composite and vision model types on the kernel route (some with wrappers too), built with every
#: sub-config at the tiny sizes as well (:func:`tiny_nested`): (extra fields, a sub-config's under its
#: name; generator?). Found by building every kernel-route type this way (the others need inputs of
#: their own: grids, audio features, query embeddings, or are not tiny from their defaults).
NESTED_ZOO: dict[str, tuple[dict[str, Any], bool]] = {
    "gptj": ({"rotary_dim": 8}, True), "codegen": ({"rotary_dim": 8}, True), "minicpm3": (_MLA, True),
    "mllama": ({}, True), "gemma4_unified": ({}, True),
    "glm4v_text": (_MROPE, False), "glm_ocr_text": (_MROPE, False), "glm_image_text": (_MROPE, False),
    "glm4v": ({"text_config": _MROPE}, False), "glm_ocr": ({"text_config": _MROPE}, False),
    "cosmos3_edge": ({}, False), "esm": ({}, False), "kosmos-2.5": ({}, False), "paddleocr_vl": ({}, False),
    "qwen3_vl": ({**_VL_IDS, "vision_config": {"out_hidden_size": 64}}, False),  # with an image: _with_image
    # hybrids: attention layers among recurrent, state-space or convolution layers
    "jamba": ({"num_hidden_layers": 8, **_MOE}, True), "lfm3": ({"num_hidden_layers": 8}, True),
    "qwen3_5_text": ({"layer_types": ["linear_attention", "full_attention"]}, True),
    "qwen3_5": ({"text_config": {"layer_types": ["linear_attention", "full_attention"]}}, True),
    "recurrent_gemma": ({"num_hidden_layers": 8}, True),
    "qwen3_next": (_QWEN_NEXT, True), "qwen3_5_moe_text": (_QWEN_NEXT, True),
    "qwen3_5_moe": ({"text_config": _QWEN_NEXT}, True),
    # images, (B, 3, 32, 32) in 16 patches
    "beit": ({}, False), "dinov3_vit": ({}, False), "dpt": ({}, False), "internvl_vision": ({}, False),
    "mlcd": ({}, False), "mlcd_vision_model": ({}, False), "pixtral": ({}, False),
    "qianfan_ocr_vision": ({}, False), "radio": ({}, False), "sam2_vision_model": ({}, False),
    "sam3_vit_model": ({}, False), "sapiens2": ({}, False), "step3p7": ({}, False),
}
PIXELS = {"beit", "dinov3_vit", "dpt", "internvl_vision", "mlcd", "mlcd_vision_model", "pixtral",
          "qianfan_ocr_vision", "radio", "sam2_vision_model", "sam3_vit_model", "sapiens2"}
#: Types compared with transformers' ``"sdpa"`` model, its default, because its eager model computes
#: other values: RecurrentGemma's recurrent layers carry the padded queries' outputs into the real
#: tokens, and eager and SDPA give a fully masked (left-padding) query row different outputs
#: (:func:`test_recurrent_gemma_eager_and_sdpa_differ_with_left_padding`).
SDPA_ORACLE = {"recurrent_gemma"}

#: The tiny sizes under other configs' names (towers, encoder-decoders, experts, query tokens), for the types
#: of :data:`SHRUNK`: applied at every level of the config where the class has the field.
SHRINK = {"depth": 2, "num_heads": 4, "num_layers": 2, "num_decoder_layers": 2, "d_model": 64, "d_ff": 128, "d_kv": 16,
          "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
          "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "out_hidden_size": 64, "projection_dim": 64,
          "num_query_tokens": 4, **_MOE}
#: Qwen2.5-VL's windows: 2 × 2 merged patches, the last of 2 blocks attending the whole image.
_WINDOWED = {"window_size": 32, "fullatt_block_indexes": [1]}
#: Whisper-style audio encoders: 8 mel bins, 32 frames (2 · max_source_positions).
_MELS = {"num_mel_bins": 8, "max_source_positions": 16}
#: Conformer audio encoders: 8 mel bins, small subsampling convolutions and depthwise kernels.
_CONFORMER = {"num_mel_bins": 8, "subsampling_conv_channels": 16, "conv_kernel_size": 3}
NESTED_ZOO.update({
    # composites on token ids
    "inkling_mm_model": ({}, False), "muse_glimmer": ({}, False), "muse_spark_text": ({}, False),
    "qwen3_vl_moe": ({}, False), "qwen2_5_vl": ({"text_config": _MROPE, **_VL_IDS}, False),  # with an image
    "glm4v_moe": ({"text_config": KERNEL_ZOO["glm4v_moe_text"][0]}, False),
    # encoder-decoders (relative position biases: T5's, UMT5's per layer), padded encoder and decoder batches
    "t5": ({"decoder_start_token_id": 0}, True), "umt5": ({}, True), "t5gemma": ({}, True),
    "seamless_m4t": ({}, True), "seamless_m4t_v2": ({}, True),
    # vision towers on flattened patches and each image's (t, h, w) grid (:func:`_grid`)
    **dict.fromkeys(("glm4v_vision", "glm4v_moe_vision", "glm_ocr_vision", "glm5_next_vision", "cohere_compass_vision",
                     "qwen3_vl_vision", "qwen3_5_vision", "qwen3_5_moe_vision", "qwen3_vl_moe_vision",
                     "qwen4_exp_vision", "glm_image_vision"), ({}, False)),
    "qwen2_5_vl_vision": (_WINDOWED, False), "exaone4_5_vision": (_WINDOWED, False),
    **dict.fromkeys(("hunyuan_vl_vision", "hy_v4_vl_vision", "video_llama_3_vision", "cosmos3_edge_vision",
                     "kimi_k25_vision", "muse_glimmer_vision", "muse_spark_vision"), ({}, False)),
    # audio encoders on log-mel features (:func:`_features`)
    **dict.fromkeys(("qwen2_audio_encoder", "voxtral_encoder", "moss_transcribe_diarize_audio", "glmasr_encoder",
                     "voxtral_realtime_encoder"), (_MELS, False)),
    "fun_asr_nano_encoder": ({**_MELS, "num_stacked_frames": 1}, False),
    "parakeet_encoder": (_CONFORMER, False), "lasr_encoder": (_CONFORMER, False),
    "wav2vec2-bert": ({"feature_projection_input_dim": 16, "conv_depthwise_kernel_size": 3, "output_hidden_size": 64},
                      False),
    "lasr_ctc": ({"encoder_config": _CONFORMER}, False),
    **dict.fromkeys(("nemotron3_5_transcribe_asr_audio", "nemotron3_diarization_audio"),
                    ({"num_mel_bins": 8, "num_key_value_heads": 4}, False)),
    # raw samples (test_zoo's speech batches), videos, time series, a language adapter
    "wav2vec2-conformer": ({"conv_dim": [32] * 7, "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4,
                            "conv_depthwise_kernel_size": 3, "output_hidden_size": 64}, False),
    # audio tokenizers' encoders (convolutions, then a windowed transformer): 16× fewer frames, 8 filters
    **dict.fromkeys(("mimi_encoder", "pocket_tts_audio_tokenizer_encoder"),
                    ({"num_filters": 8, "upsampling_ratios": [4, 4]}, False)),
    "videomae": ({"num_frames": 4, "tubelet_size": 2}, False),
    "vjepa2": ({"crop_size": 32, "frames_per_clip": 4, "pred_hidden_size": 32, "pred_num_attention_heads": 4,
                "pred_num_hidden_layers": 1, "num_pooler_layers": 1}, False),
    "timesfm": ({"patch_length": 8, "context_length": 64, "horizon_length": 8, "head_dim": 16}, False),
    "timesfm2_5": ({"patch_length": 8, "context_length": 64, "horizon_length": 8, "head_dim": 16,
                    "output_quantile_len": 16}, False),
    "xmod": ({"default_language": "en_XX"}, True),
    # dual encoders on padded token ids and images (test_zoo's DUAL_ENCODERS): each tower's states
    **dict.fromkeys(("owlv2", "owlvit", "tipsv2"), ({}, False)),
    "gemma4_vision": ({"position_embedding_size": 16, "head_dim": 16}, False),  # padded patches: _gemma4_patches
})
#: The types added to :data:`NESTED_ZOO` above, built with :data:`SHRINK` too.
SHRUNK = set(list(NESTED_ZOO)[list(NESTED_ZOO).index("inkling_mm_model"):])
#: Encoder-decoders of :data:`NESTED_ZOO`: built for generation, on test_zoo's BART batches.
SEQ2SEQ = {"t5", "umt5", "t5gemma", "seamless_m4t", "seamless_m4t_v2"}
Inputs = Callable[[str, str], dict[str, torch.Tensor]]


def _large(millions: int) -> str:
    return f"not tiny: {millions}M parameters with every sub-config at the tiny sizes (a part left at its default)"


_NEEDS = "needs inputs of its own: "
#: The kernel-route model types not compared numerically, each with why (the zoo's meta pass requires every
#: kernel-route type of the pinned transformers to be compared or listed here).
UNCOMPARED: dict[str, str] = {
    **{t: _large(n) for t, n in {
        "blip-2": 125, "blt": 193, "cohere_asr": 1896, "cosmos3_omni": 11994, "csm": 95, "exaone4_5": 9010,
        "fuyu": 9398, "gemma4": 137, "glm46v": 9672, "glm_image": 40, "glmasr": 2258, "glmga": 9672,
        "hyperclovax_vision_v2": 9705, "idefics2": 7818, "instructblip": 125, "instructblipvideo": 125,
        "internvl": 11445, "kimi_k25": 30000, "lfm2_vl": 2813, "lfm3_vl": 1738, "lighton_ocr": 1006,
        "minicpm_ocr": 7938, "minicpmv4_6": 7938, "minicpmv4_7": 7938, "mistral3": 23340,
        "moss_transcribe_diarize": 753, "nemotron3_5_asr": 620, "neucodec": 435, "ovis2": 11428, "pe_audio": 350,
        "qianfan_ocr": 11445, "qwen2_audio": 12692, "qwen2_vl": 66, "qwen3_asr": 2351, "sam3": 808,
        "sam3_lite_text": 455, "sam3_tracker": 455, "sam3_tracker_video": 462, "sam3_video": 860,
        "sam3_vision_model": 454, "t5gemma2": 94, "ultravbert": 6743, "video_llama_3": 11445, "voxtral": 4676,
        "voxtral_realtime": 4832, "xcodec2": 435}.items()},
    # inputs of their own not made here
    "blip_2_qformer": _NEEDS + "query_embeds", "muse_glimmer_assistant": _NEEDS + "noise_embeds, context states",
    "edgetam_video": _NEEDS + "a video inference session", "sam2_video": _NEEDS + "a video inference session",
"inkling2_vision": _NEEDS + "image_grid_thw patches",
    "idefics": _NEEDS + "images per text and their perceiver", "kosmos-2": _NEEDS + "images with their token mask",
    "parakeet_ctc": "its CTC logits carry no mask of the real frames, and its padded frames' rows are fully masked "
                    "(eager's softmax averages the values there, the kernel's differs); parakeet_encoder is compared",
    "parakeet_rnnt": _NEEDS + "input_features and a transducer's decoder",
    "parakeet_tdt": _NEEDS + "input_features and a transducer's decoder",
    "nemotron_asr_streaming": _NEEDS + "input_features and a transducer's decoder",
    "moonshine": _NEEDS + "raw audio and decoder ids", "layoutlmv3": _NEEDS + "bbox and pixel_values",
    "udop": _NEEDS + "bbox", "lightglue": _NEEDS + "image pairs and keypoints",
    "llama4": _NEEDS + "pixel_values (its text model takes the wrappers, its vision model the kernel)",
    "pe_audio_encoder": _NEEDS + "raw audio", "minicpm_ocr_vision": _NEEDS + "pixel_values with target_sizes",
    "minicpmv4_7_vision": _NEEDS + "pixel_values with target_sizes",
    "xclip": _NEEDS + "videos with input_ids",
    "qwen3_asr_encoder": _NEEDS + "features in n_window chunks", "sam2": _NEEDS + "1024-pixel images",
    "sam2_hiera_det_model": _NEEDS + "pixel_values at its window sizes",
    # the tiny config is refused, or transformers' own eager model fails on it
    "dia": "its config refuses the tiny recipe (channels must match the delay pattern)",
    "embedding_gemma2": "per-layer attributes: the tiny recipe's num_key_value_heads is refused",
    "ernie4_5_vl_moe": "its config takes moe_intermediate_size as a list (text and vision experts)",
    "florence2": "its vision config takes per-stage lists (patch_size, ...)",
    "molmo2": "its config takes image_size as a list", "muse_spark": "its config takes per-layer lists",
    "moshi": "its config refuses the tiny recipe (audio_vocab_size None)",
    "fun_asr_nano": "its config refuses the tiny recipe (adaptor and text hidden sizes differ)",
    "nemo_speechlm": "its config refuses the tiny recipe (hidden_size has no setter)",
    "nemotron3_diarization": "its config refuses the tiny recipe (head and audio hidden sizes differ)",
    "mistral4": "its latent attention's partial rotary width disagrees with the tiny head sizes",
    "qwen2_5_omni_thinker": "transformers' own model fails: its config lacks vision_start_token_id",
    "qwen3_omni_moe_thinker": "transformers' own model fails: its config lacks vision_start_token_id",
    "nemotron_asr_streaming_encoder": "transformers' own eager model gives NaN on the tiny config",
    "mt5": "float32 rounding: its tiny gated-GELU logits sit 1.4e-5 from eager's (transformers' SDPA model's 8e-6); "
           "in float64 2.6e-14",
}


def _grid(key: str = "hidden_states", per_patch: Callable[[Any], tuple[int, ...]] | None = None,
          **more: torch.Tensor) -> Callable[[Any], Inputs]:
    """Two images of 2 × 4 and 4 × 4 patches for a vision tower of config ``cfg``: their flattened patches
    (24, C · T · P²) under ``key`` (or ``per_patch(cfg)``'s shape) and their ``grid_thw`` (no padding)."""
    grid = torch.tensor([[1, 2, 4], [1, 4, 4]])

    def make(cfg: Any) -> Inputs:
        channels = getattr(cfg, "in_channels", None) or getattr(cfg, "num_channels", 3)
        flat = channels * getattr(cfg, "temporal_patch_size", 1) * cfg.patch_size ** 2  # C · T · P²
        shape = per_patch(cfg) if per_patch else (flat,)
        return lambda model_type, side: {key: torch.randn(24, *shape, generator=torch.Generator().manual_seed(1)),
                                         "grid_thw": grid, **more}
    return make


def _features(shape: Callable[[Any], tuple[int, int]], mask: str | None = None,
              frames: int = 1) -> Callable[[Any], Inputs]:
    """Log-mel features (2, ``*shape(cfg)``); with ``mask``, the second row's last or first quarter is padding
    (a (2, n) mask under that name, n the size of the ``frames`` dimension)."""
    def make(cfg: Any) -> Inputs:
        def inputs(model_type: str, side: str) -> dict[str, torch.Tensor]:
            features = torch.randn(2, *shape(cfg), generator=torch.Generator().manual_seed(1))
            n = features.shape[frames]
            return {"input_features": features, **({mask: _padding_mask(n, side, n // 4)} if mask else {})}
        return inputs
    return make


_WHISPER_LIKE = _features(lambda cfg: (cfg.num_mel_bins, 2 * cfg.max_source_positions))
#: The inputs of :data:`NESTED_ZOO`'s types that run on neither token ids nor (B, 3, 32, 32) images, from their config.
OWN_INPUTS: dict[str, Callable[[Any], Inputs]] = {
    **dict.fromkeys(("glm4v_vision", "glm4v_moe_vision", "glm_ocr_vision", "glm5_next_vision", "cohere_compass_vision",
                     "exaone4_5_vision", "qwen2_5_vl_vision", "qwen3_vl_vision", "qwen3_5_vision", "qwen3_5_moe_vision",
                     "qwen3_vl_moe_vision", "qwen4_exp_vision"), _grid()),
    **dict.fromkeys(("cosmos3_edge_vision", "glm_image_vision", "hunyuan_vl_vision", "hy_v4_vl_vision"),
                    _grid("pixel_values")),
    "video_llama_3_vision": _grid("pixel_values", merge_sizes=torch.tensor([2, 2])),
    "kimi_k25_vision": _grid("pixel_values", lambda cfg: (3, cfg.patch_size, cfg.patch_size)),
    **dict.fromkeys(("muse_glimmer_vision", "muse_spark_vision"),  # (2 frames a patch, not in the config)
                    _grid("pixel_values", lambda cfg: (3 * 2 * cfg.patch_size ** 2,))),
    **dict.fromkeys(("qwen2_audio_encoder", "voxtral_encoder", "moss_transcribe_diarize_audio"), _WHISPER_LIKE),
    "glmasr_encoder": _features(lambda cfg: (cfg.num_mel_bins, 32)),
    "voxtral_realtime_encoder": _features(lambda cfg: (cfg.num_mel_bins, 32)),
    "fun_asr_nano_encoder": _features(lambda cfg: (32, cfg.num_mel_bins), "input_features_mask"),
    # 64 frames, 8 after subsampling: the real ones are those of the mask the model returns
    **dict.fromkeys(("parakeet_encoder", "lasr_encoder"),
                    _features(lambda cfg: (64, cfg.num_mel_bins), "attention_mask")),
    "wav2vec2-bert": _features(lambda cfg: (16, 16), "attention_mask"),
    "lasr_ctc": _features(lambda cfg: (64, cfg.encoder_config.num_mel_bins), "attention_mask"),
    **dict.fromkeys(("nemotron3_5_transcribe_asr_audio", "nemotron3_diarization_audio"),
                    _features(lambda cfg: (64, cfg.num_mel_bins), "attention_mask")),
    **dict.fromkeys(SEQ2SEQ, lambda cfg: lambda model_type, side: _inputs("bart", side)),
    "wav2vec2-conformer": lambda cfg: lambda model_type, side: _inputs("wav2vec2", side),  # 1600 samples, padded
    **dict.fromkeys(("mimi_encoder", "pocket_tts_audio_tokenizer_encoder"),  # (B, 1, 1600) samples, padded
                    lambda cfg: lambda model_type, side: _inputs("omniasr_audio", side)),
    "videomae": lambda cfg: lambda model_type, side: _inputs("vivit", side),  # (B, 4 frames, 3, 32, 32)
    "vjepa2": lambda cfg: lambda model_type, side: {"pixel_values_videos": _inputs("vivit", side)["pixel_values"]},
    "timesfm": lambda cfg: lambda model_type, side: {**_series(), "past_values_padding": torch.zeros(2, 32),
                                                     "freq": torch.tensor([[0], [1]])},
    "timesfm2_5": lambda cfg: lambda model_type, side: _series(),
    "gemma4_vision": lambda cfg: lambda model_type, side: _gemma4_patches(cfg.patch_size, side),
    "qwen2_5_vl": lambda cfg: lambda model_type, side: _with_image(cfg, side),
    **dict.fromkeys(("qwen3_vl", "cosmos3_edge"), lambda cfg: lambda model_type, side: _with_image(cfg, side, True)),
}


def _with_image(cfg: Any, side: str, token_types: bool = False) -> dict[str, torch.Tensor]:
    """A Qwen-VL batch whose rows each hold one 4 × 4-patch image among 7 text tokens (its tokens bracketed by
    the vision start and end), the second row padded by 3 on ``side``; with ``token_types``, the
    ``mm_token_type_ids`` (1: an image token) the model asks for."""
    image = [cfg.vision_start_token_id] + [cfg.image_token_id] * (16 // cfg.vision_config.spatial_merge_size ** 2) \
        + [cfg.vision_end_token_id]
    body = [5, 6, *image, 7, 8]
    ids = torch.tensor([body + [9, 10, 11], [0] * 3 + body if side == "left" else body + [0] * 3])
    vision = cfg.vision_config
    channels = getattr(vision, "in_channels", None) or vision.num_channels
    flat = channels * getattr(vision, "temporal_patch_size", 1) * vision.patch_size ** 2  # C · T · P²
    return {"input_ids": ids, "attention_mask": _padding_mask(ids.shape[1], side),
            "pixel_values": torch.randn(32, flat, generator=torch.Generator().manual_seed(1)),
            "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]]),
            **({"mm_token_type_ids": (ids == cfg.image_token_id).long()} if token_types else {})}


def _gemma4_patches(p: int, side: str) -> dict[str, torch.Tensor]:
    """Gemma 4's vision batch: 18 patch slots (3 · p² values each) and their (x, y) positions; the first image
    6 × 3 patches, the second 3 × 3 with 9 padding slots ((-1, -1)) on ``side``."""
    def grid(w: int, h: int) -> torch.Tensor:
        return torch.stack(torch.meshgrid(torch.arange(w), torch.arange(h), indexing="xy"), -1).reshape(-1, 2)

    positions = torch.full((2, 18, 2), -1)
    positions[0] = grid(6, 3)
    positions[1, slice(0, 9) if side == "right" else slice(9, 18)] = grid(3, 3)
    return {"pixel_values": torch.rand(2, 18, 3 * p * p, generator=torch.Generator().manual_seed(1)),
            "pixel_position_ids": positions}


def _series() -> dict[str, torch.Tensor]:
    """Two series of 32 past values (4 patches of 8)."""
    return {"past_values": torch.randn(2, 32, generator=torch.Generator().manual_seed(1))}


def tiny_nested(cls: Any, extra: dict[str, Any], shrink: dict[str, Any] | None = None) -> Any:
    """Config class ``cls`` at test_zoo's tiny sizes, each of its sub-configs too (``extra[name]``
    holds a sub-config's own fields); ``shrink``'s fields too, at every level, where the class has them."""
    default = cls()
    tiny = {**TINY, **(shrink or {})}
    fields = {k: v for k, v in {**tiny, **extra}.items()
              if (hasattr(default, k) or k in extra) and k not in getattr(cls, "sub_configs", {})}
    for name, sub in getattr(cls, "sub_configs", {}).items():
        if isinstance(sub, type) and sub.__name__ != "AutoConfig":  # (AutoConfig: a backbone left as it is)
            fields[name] = tiny_nested(sub, extra.get(name, {}), shrink).to_dict()
    return cls(**fields)


def _pixels(model_type: str, side: str) -> dict[str, torch.Tensor]:
    """Two 32 × 32 images (no padding: ``side`` changes nothing)."""
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))}


def _nested(model_type: str, impl: str) -> nn.Module:
    """:data:`NESTED_ZOO`'s tiny model of ``model_type`` with ``attn_implementation=impl``, sharpened."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    extra, generator = NESTED_ZOO[model_type]
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = AutoModelForSeq2SeqLM if model_type in SEQ2SEQ else AutoModelForCausalLM if generator else AutoModel
        config = tiny_nested(CONFIG_MAPPING[model_type], extra, SHRINK if model_type in SHRUNK else None)
        model = build(model_type, config, auto, impl).eval()
    assert sum(p.numel() for p in model.parameters()) < 30_000_000  # tiny
    return sharpen(model)


def compare_nested(model_type: str) -> str:
    """``"exact"`` or what differs after ``mh.hf.patch`` in :data:`NESTED_ZOO`'s tiny model of ``model_type``,
    on its inputs (token ids, :func:`_pixels` or :data:`OWN_INPUTS`'); the kernel route must be taken."""
    generator = NESTED_ZOO[model_type][1]
    model = _nested(model_type, "sdpa" if model_type in SDPA_ORACLE else "eager")
    routes: set[str] = set()
    ran: set[str] = set()  # the kernel-route modules the compared batches reached

    def patching(m: nn.Module) -> None:
        for r in mh.hf.patch(m, report=True):
            routes.add(r.route)
            if r.route == "kernel":
                m.get_submodule(r.name).register_forward_hook(lambda *_, name=r.name: ran.add(name))

    own = OWN_INPUTS.get(model_type)
    inputs = _pixels if model_type in PIXELS else own(model.config) if own else None
    found = compare_patched(model, model_type, generator, patching, inputs)
    assert "kernel" in routes and "refused" not in routes, routes
    assert ran, f"{model_type}: no kernel-route module ran on its inputs"
    return found


@pytest.mark.parametrize("model_type", list(NESTED_ZOO))
def test_composite_kernel_route_type_is_exact(model_type: str) -> None:
    assert compare_nested(model_type) == "exact"


@pytest.mark.parametrize("model_type", ["t5", "parakeet_encoder", "gemma4_vision"])
def test_own_inputs_comparison_catches_a_kernel_that_ignores_the_mask(model_type: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted mistake on the types with inputs of their own: the kernel drops HF's mask (the padding, a
    tower's images and windows) and keeps a bias's values unmasked. The comparison must report it."""
    real = hf_kernel._mask_and_bias

    def planted(mask: torch.Tensor | None, bias: torch.Tensor | None, sk: int) -> tuple[None, torch.Tensor | None]:
        kept = real(mask, bias, sk)[1]
        return None, None if kept is None else kept.masked_fill(kept <= torch.finfo(kept.dtype).min / 2, 0.0)

    monkeypatch.setattr(hf_kernel, "_mask_and_bias", planted)
    assert compare_nested(model_type).startswith("wrong")


@pytest.mark.parametrize("model_type", ["qwen2_5_vl_vision"])
def test_own_inputs_comparison_catches_a_kernel_with_a_wrong_scale(model_type: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted mistake on types without padding (HF's towers split their images and windows themselves):
    the kernel scales the logits 10% off. The comparison must report it."""
    real = hf_kernel.attention

    def planted(query: torch.Tensor, *args: Any, scale: float | None = None, **kwargs: Any) -> Any:
        return real(query, *args, scale=1.1 * (scale or query.shape[-1] ** -0.5), **kwargs)

    monkeypatch.setattr(hf_kernel, "attention", planted)
    assert compare_nested(model_type).startswith("wrong")


def test_recurrent_gemma_eager_and_sdpa_differ_with_left_padding() -> None:
    """Why :data:`SDPA_ORACLE` holds RecurrentGemma: transformers' own eager and SDPA models agree on
    a right-padded batch and not on a left-padded one (their fully masked rows differ, and the
    recurrent layers carry them on). When they agree, it can be compared with eager like the rest."""
    eager, sdpa = _nested("recurrent_gemma", "eager"), _nested("recurrent_gemma", "sdpa")
    for side, differ in (("right", False), ("left", True)):
        inputs = _inputs("recurrent_gemma", side)
        (want, real), = _outs(eager, inputs)
        (got, _), = _outs(sdpa, inputs)
        assert (((got[real] - want[real]).abs().max() / want[real].abs().max()).item() > 1e-3) == differ


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_a_registered_class_its_description_refuses_takes_the_kernel_route_exactly(case: str) -> None:
    model_type, extra = FALLBACKS[case]
    assert compare_kernel_route(model_type, extra, generator=True) == "exact"


def gpt2_with_cross_attention(s: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tiny eager GPT-2 with cross-attention (sharpened) and its inputs: ids and mask (2, s), the
    second row left-padded by 3, and the encoder's states (2, 5, 64)."""
    from transformers import GPT2Config, GPT2Model

    torch.random.default_generator.manual_seed(0)
    config = GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=100, add_cross_attention=True)
    model = sharpen(GPT2Model._from_config(config, attn_implementation="eager").eval())
    g = torch.Generator().manual_seed(1)
    ids, mask = torch.randint(3, 100, (2, s), generator=g), torch.ones(2, s, dtype=torch.long)
    mask[1, :3] = 0
    return model, ids, mask, torch.randn(2, 5, 64, generator=g)  # context: (B, S_enc, E)


def test_a_model_with_both_routes_is_exact() -> None:
    """GPT-2 with cross-attention: its self-attention takes the wrapper, its cross-attention (which the
    wrapper refuses) the kernel; the padded batch's states equal eager's, and so do the next token's
    through the cache (an EncoderDecoderCache, whose self-attention part the wrapper fills)."""
    model, ids, mask, context = gpt2_with_cross_attention(10)
    ids, mask, step, mask2 = ids[:, :9], mask[:, :9], ids[:, 9:], mask

    def run() -> list[torch.Tensor]:
        out = model(ids, attention_mask=mask, encoder_hidden_states=context, use_cache=True)
        nxt = model(step, attention_mask=mask2, encoder_hidden_states=context, past_key_values=out.past_key_values)
        return [out.last_hidden_state[mask.bool()], nxt.last_hidden_state]

    with torch.no_grad():
        wants = run()
        routes = {r.name: r.route for r in mh.hf.patch(model, report=True)}
        gots = run()
    assert routes == {"h.0.attn": "wrapper", "h.0.crossattention": "kernel", "h.1.attn": "wrapper",
                      "h.1.crossattention": "kernel"}
    for got, want in zip(gots, wants):
        assert ((got - want).abs().max() / want.abs().max()).item() <= RTOL


def test_kernel_route_comparison_catches_a_kernel_that_ignores_the_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted mistake: the kernel drops HF's padding mask. The comparison must report it."""
    monkeypatch.setattr(hf_kernel, "_mask_and_bias", lambda mask, bias, sk: (None, None))
    assert compare_kernel_route("bitnet").startswith("wrong")


def test_kernel_route_takes_the_backend_asked_for() -> None:
    """``patch(backend=...)`` reaches the kernel route: a backend without a feature is refused by name there."""
    model = _eager("bitnet")
    mh.hf.patch(model, backend="no-such-backend")
    with pytest.raises(ValueError, match="no-such-backend"):
        _outs(model, _inputs("bitnet", "left"))
    mh.hf.unpatch(model)
    assert all("multihead_backend" not in m.__dict__ for m in model.modules())
    _outs(model, _inputs("bitnet", "left"))  # eager again


def test_kernel_route_is_not_taken_when_refused() -> None:
    """``kernel=False`` keeps registered wrappers only: an unregistered class is refused, naming both routes."""
    model = _eager("bitnet")
    with pytest.raises(ValueError, match="BitNetAttention is not a supported attention class"):
        mh.hf.patch(model, kernel=False)
    assert {r.route for r in mh.hf.routes(model, kernel=False)} == {"refused"}
    assert not mh.hf.is_patched(model)


@pytest.mark.parametrize("model_type", ["bitnet", "nanochat"])
def test_kernel_route_generates_with_the_in_place_cache(model_type: str) -> None:
    """HF's module on the kernel route writes ``mh.hf.KVCacheAdapter`` through its Cache API: the greedy
    tokens of a left-padded batch equal eager's with HF's own cache."""
    model = _eager(model_type)
    inputs = _inputs(model_type, "left")  # (B, S) ids and mask, row 1 left-padded
    greedy = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = model.generate(**inputs, **greedy)
        mh.hf.patch(model)
        got = model.generate(**inputs, cache=mh.hf.KVCacheAdapter(model, 16), **greedy)
    assert torch.equal(got, want)


def test_patching_a_kernel_routed_model_again_changes_nothing_and_unpatch_restores_it() -> None:
    model = _eager("bitnet")
    mh.hf.patch(model)
    with pytest.warns(UserWarning, match="already patched; nothing left to patch"):
        mh.hf.patch(model)
    assert mh.hf.unpatch(model).config._attn_implementation == "eager" and not mh.hf.is_patched(model)


def test_a_keyword_the_kernel_lacks_is_refused_at_patch_time() -> None:
    """DeepSeek-V3.2's attention hands its sparse top-k ``indices`` to the attention function: the
    patch refuses the module by name before any call (it took the kernel route and raised at the
    first forward). Built on meta: only the modules are needed."""
    from transformers.initialization import no_init_weights

    with warnings.catch_warnings(), torch.device("meta"), no_init_weights():
        warnings.simplefilter("ignore")
        model = build("deepseek_v32", tiny_config("deepseek_v32", **_MLA), AutoModel)
    routes = mh.hf.routes(model)
    assert routes and all(r.route == "refused" and "['indices']" in r.why for r in routes), routes
    with pytest.raises(ValueError, match=r"DeepseekV32Attention passes \['indices'\]"):
        mh.hf.patch(model)


def test_the_keywords_a_class_passes_are_read_from_its_call_of_the_attention_function(tmp_path: Any) -> None:
    """:func:`hf_routes.unimplemented_keywords` reads the keywords of the call of the function looked up
    in ``ALL_ATTENTION_FUNCTIONS``: one the kernel lacks is found, the kernel's own are not, and
    another call's keywords are not read."""
    import importlib.util

    from multihead.interop import hf_routes

    source = tmp_path / "planted_attention.py"  # two classes written as transformers writes them
    source.write_text(
        "import torch\n"
        "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n"
        "class Planted(torch.nn.Module):\n"
        "    def forward(self, q, k, v, mask, **kwargs):\n"
        "        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface('eager', None)\n"
        "        print(q, block_table=1)\n"
        "        return attention_interface(self, q, k, v, mask, scaling=0.5, dropout=0.0, sliding_window=None,\n"
        "                                   top_k_blocks=4, **kwargs)\n"
        "class Known(Planted):\n"
        "    def forward(self, q, k, v, mask, **kwargs):\n"
        "        fn = ALL_ATTENTION_FUNCTIONS['sdpa']\n"
        "        return fn(self, query=q, key=k, value=v, attention_mask=mask, s_aux=None, **kwargs)\n",
        encoding="utf-8")
    spec = importlib.util.spec_from_file_location("planted_attention", source)
    assert spec is not None and spec.loader is not None
    planted = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planted)
    assert hf_routes.dispatches_class(planted.Planted) and hf_routes.dispatches_class(planted.Known)
    assert hf_routes.unimplemented_keywords(planted.Planted) == {"top_k_blocks"}
    assert hf_routes.unimplemented_keywords(planted.Known) == frozenset()


def test_cosmos3_edge_with_an_image_catches_its_text_attention_described_as_llamas(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Cosmos3-Edge's text attention described as it was, Llama's copy with 1-D RoPE: exact on text
    alone, it differs once an image gives the tokens M-RoPE positions. The comparison must report it."""
    import dataclasses

    from multihead.interop import hf_registry

    key = "transformers.models.cosmos3_edge.modeling_cosmos3_edge.Cosmos3EdgeTextAttention"
    llama = hf_registry.REGISTRY["transformers.models.llama.modeling_llama.LlamaAttention"]
    monkeypatch.setitem(hf_registry.REGISTRY, key, dataclasses.replace(
        hf_registry.REGISTRY[key], rope=llama.rope, call=llama.call, check=llama.check))
    assert compare_nested("cosmos3_edge").startswith("wrong")
