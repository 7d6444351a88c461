"""Hugging Face attention classes that are copies of a verified class, described by its entry.

Notation: E embed_dim, H query heads, Hkv key/value heads, D head_dim.

transformers copies attention classes between model packages ("Copied from", modular files):
DeiT's attention is ViT's, Camembert's is BERT's, Aria's text attention is Llama's. A copy's
registry entry (:class:`~multihead.interop.hf_registry.AttentionSpec`, derived there from this
table) is its original's with
the copy's class, its config model types, and its part classes renamed (the original's class
prefix replaced by the copy's: ``BertSelfOutput`` -> ``CamembertSelfOutput``). So a copy is
converted and patched exactly as its original, and refused where its original is (the same
options, checks and attributes).

Each :class:`Copy` states how its source differs from the original's, in the class and in
the module's functions the class calls (:data:`HELPERS`), the class prefix aside, comments,
docstrings and blank lines dropped: ``differs`` holds the lines of that diff
(``"<object>: -<original's line>"`` / ``"<object>: +<copy's line>"``), empty for a verbatim
copy; ``why`` says why they change nothing the description does not read from the module
(``is_causal``, ``sliding_window``), or what they change (an eager kernel's softmax dtype).
``tests/interop/test_copied_families.py`` compares the sources in the installed transformers
(a class that changes is caught there) and ``tests/interop/test_zoo.py`` compares every model
type numerically, patched against unpatched.

This module imports nothing from transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Copy", "COPIES", "HELPERS", "class_prefix"]

#: The module-level functions of a modeling file that its attention classes call.
HELPERS = ("eager_attention_forward", "apply_rotary_pos_emb", "rotate_half", "repeat_kv")


@dataclass(frozen=True)
class Copy:
    """One copied class: ``transformers.models.<module>.<cls>``, a copy of ``of`` (same form)."""

    module: str
    cls: str
    model_types: tuple[str, ...]
    of: str
    differs: tuple[str, ...] = ()
    why: str = ""
    #: plain attributes the copy sets besides its original's (each explained in ``why``)
    attrs: frozenset[str] = frozenset()

    @property
    def qualified(self) -> str:
        """The copy's qualified name (the registry's key)."""
        return f"transformers.models.{self.module}.{self.cls}"

    @property
    def original(self) -> str:
        """The original's qualified name."""
        return f"transformers.models.{self.of}"


def class_prefix(name: str) -> str:
    """``BertSelfAttention`` -> ``Bert``, ``LlamaAttention`` -> ``Llama``: the model's prefix of a class name."""
    for suffix in ("SelfAttention", "Attention"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


def _vit(module: str, cls: str, *types: str, **kw: Any) -> Copy:
    return Copy(module, cls, types, "vit.modeling_vit.ViTAttention", **kw)


def _bert(module: str, prefix: str, *types: str) -> list[Copy]:
    """BertAttention and the BertSelfAttention inside it, both verbatim."""
    return [Copy(module, f"{prefix}Attention", types, "bert.modeling_bert.BertAttention"),
            Copy(module, f"{prefix}SelfAttention", types, "bert.modeling_bert.BertSelfAttention")]


_LAYOUTLM = "layoutlm.modeling_layoutlm.LayoutLM"


def _layoutlm(module: str, prefix: str, *types: str) -> list[Copy]:
    """LayoutLMAttention and the LayoutLMSelfAttention inside it, both verbatim."""
    return [Copy(module, f"{prefix}Attention", types, f"{_LAYOUTLM}Attention"),
            Copy(module, f"{prefix}SelfAttention", types, f"{_LAYOUTLM}SelfAttention")]


_LLAMA = "llama.modeling_llama.LlamaAttention"
_CLIP = "clip.modeling_clip.CLIPAttention"
_SIGLIP = "siglip.modeling_siglip.SiglipAttention"
_DEEPSEEK_V3 = "deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention"
_WAV2VEC2 = "wav2vec2.modeling_wav2vec2.Wav2Vec2Attention"
#: The eager kernel of these modules runs its softmax in the input dtype, not float32 (ours
#: runs in float32 at least): the same in float32, and more accurate in half precision.
_SOFTMAX_DTYPE = {
    "differs": ("eager_attention_forward: -    attn_weights = nn.functional.softmax(attn_weights, dim=-1, "
                "dtype=torch.float32).to(query.dtype)",
                "eager_attention_forward: +    attn_weights = nn.functional.softmax(attn_weights, dim=-1)"),
    "why": "its eager_attention_forward runs softmax in the input dtype (ViT's in float32, as ours)"}

COPIES: tuple[Copy, ...] = (
    # ---- ViT's attention (q/k/v_proj + o_proj, bidirectional, no position encoding inside) ----
    _vit("deit.modeling_deit", "DeiTAttention", "deit"),
    _vit("vit_mae.modeling_vit_mae", "ViTMAEAttention", "vit_mae"),
    _vit("vit_msn.modeling_vit_msn", "ViTMSNAttention", "vit_msn"),
    _vit("ijepa.modeling_ijepa", "IJepaAttention", "ijepa"),
    _vit("vivit.modeling_vivit", "VivitAttention", "vivit"),
    _vit("pixio.modeling_pixio", "PixioAttention", "pixio"),
    _vit("audio_spectrogram_transformer.modeling_audio_spectrogram_transformer", "ASTAttention",
         "audio-spectrogram-transformer"),
    _vit("dinov2.modeling_dinov2", "Dinov2Attention", "dinov2", **_SOFTMAX_DTYPE),
    _vit("dinov2_with_registers.modeling_dinov2_with_registers", "Dinov2WithRegistersAttention",
         "dinov2_with_registers", **_SOFTMAX_DTYPE),
    _vit("tipsv2.modeling_tipsv2", "Tipsv2VisionAttention", "tipsv2_vision_model", **_SOFTMAX_DTYPE),
    # ---- BERT's (BertAttention = self-attention + BertSelfOutput) ----
    *_bert("camembert.modeling_camembert", "Camembert", "camembert"),
    *_bert("data2vec.modeling_data2vec_text", "Data2VecText", "data2vec-text"),
    *_bert("ernie.modeling_ernie", "Ernie", "ernie"),
    *_bert("roc_bert.modeling_roc_bert", "RoCBert", "roc_bert"),
    *_bert("bert_generation.modeling_bert_generation", "BertGeneration", "bert-generation"),
    # ---- LayoutLM's (BERT's encoder-only form) ----
    # (not MarkupLM's: its model hands attention a -10000 additive mask, refused by the mask converter)
    *(copy for module, prefix, model_type in (("splinter", "Splinter", "splinter"),
                                              ("align", "AlignText", "align_text_model"))
      for copy in _layoutlm(f"{module}.modeling_{module}", prefix, model_type)),
    *(copy for module, prefix, model_type in (("chinese_clip", "ChineseCLIPText", "chinese_clip_text_model"),
                                              ("altclip", "AltRoberta", "altclip_text_model"))
      for copy in (Copy(f"{module}.modeling_{module}", f"{prefix}Attention", (model_type,), f"{_LAYOUTLM}Attention"),
                   Copy(f"{module}.modeling_{module}", f"{prefix}SelfAttention", (model_type,),
                        f"{_LAYOUTLM}SelfAttention", differs=("class: +        self.is_causal = False",),
                        why="is_causal False: what LayoutLM's is read as, without the attribute"))),
    # ---- CLIP's and SigLIP's (q/k/v_proj + out_proj) ----
    Copy("metaclip_2.modeling_metaclip_2", "MetaClip2Attention", ("metaclip_2_text_model", "metaclip_2_vision_model"),
         _CLIP),
    Copy("clipseg.modeling_clipseg", "CLIPSegAttention", ("clipseg_text_model", "clipseg_vision_model"), _CLIP),
    Copy("altclip.modeling_altclip", "AltCLIPAttention", ("altclip_vision_model",), _CLIP,
         differs=("eager_attention_forward: -    **kwargs: Unpack[TransformersKwargs],",
                  "eager_attention_forward: +    **kwargs,",
                  "eager_attention_forward: -    attn_weights = torch.matmul(query, key.transpose(-1, -2)) * scaling",
                  "eager_attention_forward: +    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling"),
         why="the eager kernel's key.transpose(2, 3) is transpose(-1, -2) on (B, H, S, D)"),
    Copy("siglip2.modeling_siglip2", "Siglip2Attention", ("siglip2_text_model", "siglip2_vision_model"), _SIGLIP),
    # ---- Llama's and its verified copies' ----
    Copy("aria.modeling_aria", "AriaTextAttention", ("aria_text",), _LLAMA),
    Copy("granite_docling.modeling_granite_docling", "GraniteDoclingTextAttention", ("granite_docling_text",),
         "granite.modeling_granite.GraniteAttention"),
    Copy("apertus1p5.modeling_apertus1p5", "Apertus1p5TextAttention", ("apertus1p5_text",),
         "apertus.modeling_apertus.ApertusAttention"),
    # ---- Wav2Vec2's (BART's without a cache) in the speech encoders and PatchTST ----
    *(Copy(f"{module}.modeling_{module}", f"{prefix}Attention", (model_type,), _WAV2VEC2)
      for module, prefix, model_type in (("hubert", "Hubert", "hubert"), ("sew", "SEW", "sew"),
                                         ("unispeech", "UniSpeech", "unispeech"),
                                         ("unispeech_sat", "UniSpeechSat", "unispeech-sat"),
                                         ("patchtst", "PatchTST", "patchtst"))),
    Copy("data2vec.modeling_data2vec_audio", "Data2VecAudioAttention", ("data2vec-audio",), _WAV2VEC2),
    Copy("omniasr.modeling_omniasr", "OmniASRAttention", ("omniasr_audio",), _WAV2VEC2),
    # ---- Whisper's in Audio Flamingo 3's encoder ----
    Copy("audioflamingo3.modeling_audioflamingo3", "AudioFlamingo3Attention", ("audioflamingo3_encoder",),
         "whisper.modeling_whisper.WhisperAttention"),
    # ---- others ----
    Copy("decision_transformer.modeling_decision_transformer", "DecisionTransformerGPT2Attention",
         ("decision_transformer",), "gpt2.modeling_gpt2.GPT2Attention"),
    Copy("glm4_moe_lite.modeling_glm4_moe_lite", "Glm4MoeLiteAttention", ("glm4_moe_lite",), _DEEPSEEK_V3),
    Copy("youtu.modeling_youtu", "YoutuAttention", ("youtu",), _DEEPSEEK_V3),
    # ---- near copies: the lines that differ set what the description reads from the module ----
    Copy('eurobert.modeling_eurobert', 'EuroBertAttention', ('eurobert',), _LLAMA,
         differs=(
             'class: -        self.is_causal = True',
             'class: +        self.is_causal = False',
         ),
         why='bidirectional: is_causal is read from the module'),
    Copy('vaultgemma.modeling_vaultgemma', 'VaultGemmaAttention', ('vaultgemma',),
         'gemma2.modeling_gemma2.Gemma2Attention',
         differs=(
             'class: -        self.is_causal = not getattr(config, "use_bidirectional_attention", False)',
             'class: +        self.is_causal = True',
         ),
         why='always causal: is_causal is read from the module'),
    Copy('chinese_clip.modeling_chinese_clip', 'ChineseCLIPVisionAttention', ('chinese_clip_vision_model',), _CLIP,
         differs=(
             'class: -    def __init__(self, config: CLIPVisionConfig | CLIPTextConfig):',
             'class: +    def __init__(self, config: CLIPConfig | ChineseCLIPTextConfig):',
             'eager_attention_forward: -    **kwargs: Unpack[TransformersKwargs],',
             'eager_attention_forward: +    **kwargs,',
             'eager_attention_forward: -    attn_weights = torch.matmul(query, key.transpose(-1, -2)) * scaling',
             'eager_attention_forward: +    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling',
         ),
         why="a type annotation; the eager kernel's key.transpose(2, 3) is transpose(-1, -2) on (B, H, S, D)"),
    Copy('idefics3.modeling_idefics3', 'Idefics3VisionAttention', ('idefics3_vision',), _SIGLIP,
         differs=(
             'class: -        self.is_causal = False',
             'class: +        self.is_causal = False',
         ),
         why='is_causal is set after the projections'),
    Copy('smolvlm.modeling_smolvlm', 'SmolVLMVisionAttention', ('smolvlm_vision',), _SIGLIP,
         differs=(
             'class: -        self.is_causal = False',
             'class: +        self.is_causal = False',
         ),
         why='is_causal is set after the projections'),
    Copy('git.modeling_git', 'GitVisionAttention', ('git_vision_model',), _SIGLIP,
         differs=(
             'class: -        **kwargs,',
             'class: +        **kwargs: Unpack[TransformersKwargs],',
             'class: +            **kwargs,',
         ),
         why="the keywords reach HF's kernel (GitVisionEncoder passes none that it reads)"),
    Copy("granite_docling.modeling_granite_docling", "GraniteDoclingVisionAttention", ("granite_docling_vision",),
         _SIGLIP, attrs=frozenset({"num_key_value_groups"}),
         differs=(
             "class: -        self.is_causal = False",
             "class: +        self.is_causal = False",
             "class: +        self.num_key_value_groups = 1",
             "eager_attention_forward: -    **kwargs,",
             "eager_attention_forward: +    **kwargs: Unpack[TransformersKwargs],",
             "eager_attention_forward: -    attn_weights = torch.matmul(query, key.transpose(-1, -2)) * scaling",
             "eager_attention_forward: +    key_states = repeat_kv(key, module.num_key_value_groups)",
             "eager_attention_forward: +    value_states = repeat_kv(value, module.num_key_value_groups)",
             "eager_attention_forward: +    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling",
             "eager_attention_forward: -    attn_output = torch.matmul(attn_weights, value)",
             "eager_attention_forward: +    attn_output = torch.matmul(attn_weights, value_states)",
         ),
         why="num_key_value_groups = 1: the eager kernel's repeat_kv by 1 returns K/V as they are"),
    Copy('solar_open.modeling_solar_open', 'SolarOpenAttention', ('solar_open',), _LLAMA,
         differs=(
             'class: -        self.o_proj = nn.Linear(',
             'class: -            config.num_attention_heads * self.head_dim, config.hidden_size, '
             'bias=config.attention_bias',
             'class: -        )',
             'class: +        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, '
             'config.hidden_size, bias=False)',
         ),
         why='o_proj without bias: read from the weights'),
    Copy('helium.modeling_helium', 'HeliumAttention', ('helium',), 'glm.modeling_glm.GlmAttention',
         differs=(
             'class: -        self.scaling = self.head_dim**-0.5',
             'class: +        self.scaling = 1 / math.sqrt(self.head_dim)',
             'class: -        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, '
             'config.hidden_size, bias=False)',
             'class: +        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)',
             'apply_rotary_pos_emb: -    rotary_dim = cos.shape[-1]',
             'apply_rotary_pos_emb: -    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]',
             'apply_rotary_pos_emb: -    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]',
             'apply_rotary_pos_emb: -    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)',
             'apply_rotary_pos_emb: -    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)',
             'apply_rotary_pos_emb: -    q_embed = torch.cat([q_embed, q_pass], dim=-1)',
             'apply_rotary_pos_emb: -    k_embed = torch.cat([k_embed, k_pass], dim=-1)',
             'apply_rotary_pos_emb: +    q_embed = (q * cos) + (rotate_half(q) * sin)',
             'apply_rotary_pos_emb: +    k_embed = (k * cos) + (rotate_half(k) * sin)',
         ),
         why="scaling is read from the module, o_proj's shape from the weights; its RoPE is GLM's with every dim "
             "rotated (the partial_rotary_factor checked as GLM's)"),
    Copy('cwm.modeling_cwm', 'CwmAttention', ('cwm',), 'qwen2.modeling_qwen2.Qwen2Attention',
         differs=(
             'class: -        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * '
             'self.head_dim, bias=True)',
             'class: -        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * '
             'self.head_dim, bias=True)',
             'class: -        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * '
             'self.head_dim, bias=True)',
             'class: +        self.q_proj = torch.nn.Linear(config.hidden_size, config.num_attention_heads * '
             'self.head_dim, bias=False)',
             'class: +        self.k_proj = torch.nn.Linear(config.hidden_size, config.num_key_value_heads * '
             'self.head_dim, bias=False)',
             'class: +        self.v_proj = torch.nn.Linear(config.hidden_size, config.num_key_value_heads * '
             'self.head_dim, bias=False)',
         ),
         why='q/k/v_proj without bias: read from the weights'),
)

