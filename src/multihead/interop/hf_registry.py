"""Which Hugging Face attention classes multihead converts, each described in full.

Notation: E embed_dim, H query heads, Hkv key/value heads, D head_dim.

Exact or refused: a module is converted (and patched) only when its class is listed
here **and** it has no submodule and no attribute that its description does not account
for. Nothing is inferred from weight names: a class that looks like Llama (``q_proj`` ...
``o_proj``) but is not listed is refused by name, since it may add RoPE where there is
none (ViT), pair RoPE differently (Cohere), normalise q/k, gate, clip, soft-cap, add
sinks or relative positions.

Each :class:`AttentionSpec` states, for one class (by its qualified name, so transformers
is never imported here):

* ``layout``: where the weights are (``"q_proj"``: q/k/v/o_proj nn.Linear, our layout;
  ``"bert"``: ``self.query/key/value`` + ``output.dense``; ``"bert-self"``: query/key/value
  without W_o; ``"gpt2"``: fused transposed Conv1D ``c_attn`` + ``c_proj``; ``"phi3"``: fused
  ``qkv_proj`` rows [q | k | v] + ``o_proj``; ``"qkv-grouped"``: fused ``query_key_value``
  whose rows are groups of [q_1 .. q_g | k | v] heads, + ``dense``: GPT-NeoX, BLOOM and Falcon,
  grouping in :func:`qkv_groups`; ``"out_proj"``: q/k/v_proj +
  ``out_proj`` nn.Linear, CLIP, SigLIP, OPT, BART (and its copies), mBART, Whisper, where a projection may lack its
  bias, Whisper's k_proj; ``"distilbert"``: ``q_lin/k_lin/v_lin/out_lin``; ``"dense"``: q/k/v_proj + ``dense``
  nn.Linear (Phi); ``"wqkv"``: fused ``Wqkv`` rows [q | k | v] + ``Wo`` (ModernBERT); ``"latent"``:
  DeepSeek's multi-head latent attention, converted to
  :class:`~multihead.MultiHeadLatentAttention`, its own names). ``partial_rotary``:
  the class rotates the first ``int(D · partial_rotary_factor)`` dims (Phi-3, GPT-NeoX, Phi,
  StableLM; GLM in interleaved pairs).
* ``call``: the forward signature the patch wrapper imitates (``"llama"``, ``"vit"``,
  ``"bert"``, ``"bert-encoder"`` (BERT's without a cache, returning the output alone: LayoutLM), ``"gpt2"``,
  ``"gpt_neox"``, ``"falcon"``, ``"bloom"``, ``"clip"`` (ViT's, with
  the ``is_causal`` keyword HF's kernels obey), ``"opt"``, ``"bart"`` (``hidden_states,
  key_value_states, cache, attention_mask``, filling HF's ``EncoderDecoderCache`` as the class
  does), ``"latent"``, ``"mrope"`` (Llama's keywords; the (3, B, S) M-RoPE positions read where
  the text model's rotary embedding takes them: :mod:`multihead.interop.hf_mrope`); ``None``:
  converted by ``from_hf`` but never patched alone).
* ``cross_attention``: the class attends to another sequence when its forward is given
  one (``key_value_states``: BART's, its copies', mBART's, Whisper's decoders); the wrapper does the same,
  caching the encoder's keys and values once as HF does. A module whose
  ``is_cross_attention`` attribute is set is refused whatever its class.
* ``parts``: every submodule path and its class name, exactly; ``attrs``: the plain
  attributes the class may set (a new attribute in a later transformers means new
  behaviour, so it is refused until someone reads the code). ``alternatives``: groups of
  submodules of which exactly one is present besides ``parts`` (DeepSeek: ``q_proj``, or
  ``q_a_proj`` + ``q_a_layernorm`` + ``q_b_proj`` when ``q_lora_rank`` is set); an
  ``attrs`` path that is absent is not read.
* ``rope``: ``None`` (no position encoding inside attention), ``"half"`` (rotate-half,
  HF Llama), ``"interleaved"`` (pairs (2p, 2p+1), Cohere) or ``"rope_interleave"``
  (interleaved when ``config.rope_interleave`` is true, rotate-half otherwise, DeepSeek-V3)
  or ``"mrope"`` / ``"mrope_interleaved"`` (M-RoPE: rotate-half whose frequency slots read three
  position rows in ``mrope_section`` chunks, Qwen2-VL and Qwen2.5-VL text, or interleaved,
  Qwen3-VL text: :data:`MROPE_KINDS`);
  base and scaling are read by
  :mod:`multihead.interop.hf_config` (only ``rope_type="default"``, full rotary).
* ``rope_on``: where set, the layer applies its RoPE only when ``rope_on(module, config)``
  holds and none otherwise (no-RoPE layers: SmolLM3's ``use_rope``, Cohere 2's global layers).
  ``layer_type_attr``: the module attribute naming its layer type (``"full_attention"`` /
  ``"sliding_attention"``), which picks its ``rope_parameters`` where the config nests them per
  layer type (OLMo 3: ``attention_type``); :data:`CONFIG_LAYER_TYPE`: the class has none, its
  model picks them by ``config.layer_types[module.layer_idx]`` (ModernBERT).
* ``window``: ``None`` (never a window), ``"module"`` (``module.sliding_window``, per layer),
  ``"is_sliding"`` (``module.sliding_window`` where ``module.is_sliding``, none elsewhere: EXAONE 4)
  or ``"config"`` (``config.sliding_window``, what the class's forward passes to HF's kernel).
* ``config_must``: config keys whose other values change the computation, with the value
  this description covers (e.g. OLMo's ``clip_qkv`` must be None). ``config_equal``: pairs
  of config keys that must hold equal values (DeepSeek: ``num_key_value_heads`` and
  ``num_attention_heads``).
* ``resid_dropout``: a config key of a dropout the module applies after o_proj (Starcoder2).
* ``qk_norm``: ``"head"`` (RMSNorm ``q_norm``/``k_norm`` over D, Qwen3, Gemma 3),
  ``"proj"`` (over the whole projection, OLMo 2) or ``"head_after_rope"`` (over D, of the rotated
  q and k: HunYuan dense); ``norm_names``: the two norms' submodule names (HunYuan's
  ``query_layernorm``/``key_layernorm``); ``rope_theta``: ``(module, config) -> θ or None``, a
  RoPE base the class computes itself in place of the config's RoPE (HunYuan's NTK-alpha),
  None where it reads the config as usual; ``norm_offset``: the weight is stored as
  ``w - 1`` (Gemma). ``softcap``: the module's ``attn_logit_softcapping`` is applied
  (Gemma 2/3). ``params``: the module's own parameters besides its submodules' (gpt-oss's
  ``sinks``); any other is refused. RoPE scaling (``rope_type`` linear, dynamic, llama3,
  yarn, longrope) is read from the config for every RoPE class.
* ``model_types``: the config model types the class is verified with (the zoo test
  compares each); the class with any other config class is refused, since another config
  may name its RoPE or window keys differently.
* ``alibi``: ALiBi with the standard slopes of H heads instead of RoPE (BLOOM).
  ``config_free``: the module holds every fact it computes with and has no ``config``
  (BLOOM); without a config it is accepted, a config given must still be of a verified type.
  ``check``: the family's own rule on its module and config (Falcon's variants, BLOOM's
  tensor-parallel options), raising ValueError/TypeError with the reason, naming the key.
  ``alone``: a rule refusing what a layer converted alone (``from_hf``) does not compute but the
  family's wrapper does (Llama 4's temperature tuning: its wrapper, ``call="llama4"``, also
  computes its chunked attention).
* ``norm_weight``: False where the q/k norm has no weight (Llama 4's L2 norm: ours holds ones,
  a non-persistent buffer). ``notes``: what the family's wrapper computes besides the fields
  above, for the docs' table.

Causality comes from the module's ``is_causal``, the scale from its ``scaling``, biases
and head counts from the weights, for every entry.

Adding a family: check the class's ``__init__`` and ``forward`` line by line, add one
entry below (or to ``_Q_PROJ`` / ``_BERT``; a copy of a described class: one line in
:data:`multihead.interop.hf_copies.COPIES`, with the lines that differ), add its model type to the zoo test's tiny
configs (``tests/interop/test_zoo.py``) and regenerate the docs' table (docs/guides/huggingface.md) with
``python -m multihead.interop.hf_registry``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from . import hf_config  # the one reader of config facts
from . import hf_copies

__all__ = ["AttentionSpec", "REGISTRY", "spec_of", "require_spec", "why_not", "qualified_name", "markdown_table",
           "CONFIG_LAYER_TYPE", "llama4_chunk", "llama4_temperature"]

#: ``layer_type_attr`` of a class whose layer type is ``config.layer_types[module.layer_idx]``.
CONFIG_LAYER_TYPE = "config.layer_types[layer_idx]"


@dataclass(frozen=True)
class AttentionSpec:
    """The complete semantics of one Hugging Face attention class (see the module docstring)."""

    cls: str
    model_types: tuple[str, ...]
    layout: str
    call: str | None
    parts: Mapping[str, str]
    attrs: Mapping[str, frozenset[str]]
    rope: str | None = None
    window: str | None = None
    config_must: Mapping[str, Any] = field(default_factory=dict)
    resid_dropout: str | None = None
    qk_norm: str | None = None
    norm_offset: bool = False
    partial_rotary: bool = False
    softcap: bool = False
    params: frozenset[str] = frozenset()
    alibi: bool = False
    config_free: bool = False
    check: Callable[[Any, Any], None] | None = None
    cross_attention: bool = False
    alternatives: tuple[Mapping[str, str], ...] = ()
    config_equal: tuple[tuple[str, str], ...] = ()
    rope_on: Callable[[Any, Any], bool] | None = None
    layer_type_attr: str = "layer_type"
    copy_of: str | None = None
    norm_names: tuple[str, str] = ("q_norm", "k_norm")
    rope_theta: Callable[[Any, Any], float | None] | None = None
    norm_weight: bool = True
    alone: Callable[[Any, Any], None] | None = None
    notes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The class name without its module."""
        return self.cls.rpartition(".")[2]


_LINEARS = {n: "Linear" for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
_LLAMA_ATTRS = frozenset({"attention_dropout", "config", "head_dim", "is_causal", "layer_idx",
                          "num_key_value_groups", "scaling"})


def _q_proj(model_type: str, cls: str, *, also: tuple[str, ...] = (), rope: str | None = "half",
            window: str | None = None, extra_attrs: frozenset[str] = frozenset(), call: str = "llama",
            norm: str | None = None, module: str | None = None, norm_names: tuple[str, str] = ("q_norm", "k_norm"),
            **kw: Any) -> AttentionSpec:
    module = module or model_type.replace("-", "_")
    parts = _LINEARS if norm is None else {**_LINEARS, **dict.fromkeys(norm_names, norm)}
    return AttentionSpec(f"transformers.models.{module}.modeling_{module}.{cls}", (model_type, *also), "q_proj", call,
                         parts, {"": _LLAMA_ATTRS | extra_attrs}, rope=rope, window=window, norm_names=norm_names,
                         **kw)


_LAYER_TYPED = frozenset({"layer_type", "sliding_window"})


def _bert(model_type: str, prefix: str, also: tuple[str, ...] = (), *, encoder: bool = False) -> list[AttentionSpec]:
    """BertAttention (``self`` + ``output``) and its BertSelfAttention. ``encoder``: the encoder-only
    form (LayoutLM's): no cache, no ``is_decoder``/``layer_idx``, the attention's output returned alone."""
    module = model_type.replace("-", "_")
    path = f"transformers.models.{module}.modeling_{module}."
    self_parts = {"query": "Linear", "key": "Linear", "value": "Linear", "dropout": "Dropout"}
    self_attrs = frozenset({"all_head_size", "attention_head_size", "config", "is_causal", "is_decoder",
                            "layer_idx", "num_attention_heads", "scaling"})
    if encoder:
        self_attrs = self_attrs - {"is_decoder", "layer_idx"} | {"attention_dropout"}
    parts = {"self": f"{prefix}SelfAttention", **{f"self.{k}": v for k, v in self_parts.items()},
             "output": f"{prefix}SelfOutput", "output.dense": "Linear", "output.LayerNorm": "LayerNorm",
             "output.dropout": "Dropout"}
    own = frozenset() if encoder else frozenset({"is_cross_attention"})
    return [
        AttentionSpec(path + f"{prefix}Attention", (model_type, *also), "bert", "bert-encoder" if encoder else "bert",
                      parts, {"": own, "self": self_attrs, "output": frozenset()}),
        AttentionSpec(path + f"{prefix}SelfAttention", (model_type, *also), "bert-self", None, self_parts,
                      {"": self_attrs}),
    ]


_GPT2 = AttentionSpec(
    "transformers.models.gpt2.modeling_gpt2.GPT2Attention", ("gpt2",), "gpt2", "gpt2",
    {"c_attn": "Conv1D", "c_proj": "Conv1D", "attn_dropout": "Dropout", "resid_dropout": "Dropout"},
    {"": frozenset({"config", "embed_dim", "head_dim", "is_causal", "is_cross_attention", "layer_idx", "num_heads",
                    "reorder_and_upcast_attn", "scale_attn_by_inverse_layer_idx", "scale_attn_weights",
                    "scaling", "split_size"})},
)

# ---- fused query_key_value families: GPT-NeoX (Pythia), Falcon, BLOOM (issue #15) -----------------
def _check_gpt_neox(module: Any, config: Any) -> None:
    """GPT-NeoX: its RoPE table must rotate what the attention rotates (``rotary_ndims``)."""
    src = "GPTNeoXAttention config"
    head_dim = hf_config.field(config, "head_dim")
    if head_dim is not None and head_dim != module.head_size:
        # GPTNeoXRotaryEmbedding sizes its table by config.head_dim, the attention by E / H.
        raise ValueError(f"config.head_dim={head_dim!r} differs from hidden_size // num_attention_heads = "
                         f"{module.head_size}: transformers' RoPE table and attention would disagree")
    _, _, factor = hf_config.module_rope(config, None, src, partial=True)
    rotary = int(module.head_size * factor)
    if factor > 1 or rotary != module.rotary_ndims or rotary % 2:
        raise ValueError(f"partial_rotary_factor={factor} rotates {rotary} of {module.head_size} dims (module "
                         f"rotary_ndims={module.rotary_ndims}); only an even count <= head_dim that equals "
                         "rotary_ndims is supported")


# ---- the fused query_key_value layout (GPT-NeoX, Falcon, BLOOM) ----------------------------------------
def qkv_groups(module: Any) -> tuple[int, int, int]:
    """(G, g, D): ``module.query_key_value``'s rows are G groups of [q_1 .. q_g | k | v], D rows a head.

    As each class's forward splits them: GPT-NeoX (``view(..., H, 3·D)``, chunk), BLOOM and
    Persimmon (``view(..., H, 3, D)``) are (H, 1, D); Falcon is (Hkv, H / Hkv, D) with
    ``new_decoder_architecture``, (1, H, D) with ``multi_query`` (one K/V head), (H, 1, D)
    otherwise. Query head ``i·g + r`` reads K/V head ``i``: our GQA grouping.

    Raises:
        ValueError, TypeError: a Falcon variant transformers cannot run (``num_kv_heads`` that
            does not divide the heads, or differs from them without the new architecture), or a
            fused weight of another height, naming the attribute.
    """
    name = type(module).__name__
    if name == "FalconAttention":
        heads, head_dim = module.num_heads, module.head_dim
        groups, per = _falcon_groups(module, heads)
    elif name == "GPTNeoXAttention":
        heads, head_dim = module.config.num_attention_heads, module.head_size
        groups, per = heads, 1
    else:  # BloomAttention, PersimmonAttention (view(..., H, 3, D))
        heads, head_dim = module.num_heads, module.head_dim
        groups, per = heads, 1
    rows = module.query_key_value.weight.shape[0]
    if rows != groups * (per + 2) * head_dim:
        raise ValueError(f"{name}.query_key_value has {rows} rows; its layout needs {groups} groups of "
                         f"({per} + 2) heads of {head_dim} = {groups * (per + 2) * head_dim}")
    return groups, per, head_dim


def _falcon_groups(module: Any, heads: int) -> tuple[int, int]:
    new, multi_query, kv = module.new_decoder_architecture, module.multi_query, module.num_kv_heads
    for key, value in (("new_decoder_architecture", new), ("multi_query", multi_query)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{key} must be true or false, got {type(value).__name__} {value!r}")
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1:
        raise TypeError(f"num_kv_heads must be an int >= 1, got {type(kv).__name__} {kv!r}")
    if new:
        if heads % kv:
            raise ValueError(f"num_kv_heads={kv} must divide num_attention_heads={heads} "
                             "(new_decoder_architecture groups the heads by K/V head)")
        return kv, heads // kv
    if multi_query:
        return 1, heads
    if kv != heads:  # FalconAttention.forward reshapes K/V of H heads into num_kv_heads heads: it fails
        raise ValueError(f"num_kv_heads={kv} with multi_query=False and new_decoder_architecture=False: "
                         f"transformers' FalconAttention only runs num_kv_heads=num_attention_heads={heads}")
    return heads, 1


def _check_falcon(module: Any, config: Any) -> None:
    """Falcon: RoPE only (``alibi`` must be false); the fused layout must be one HF can run."""
    if hf_config.module_flag(config, "alibi", "FalconAttention config"):
        # build_alibi_tensor rounds slope * position to bfloat16, and the eager path adds the bias
        # twice (in the scores and again in the mask): eager and sdpa disagree, nothing to imitate.
        raise ValueError("config.alibi=True is not supported: transformers' Falcon ALiBi rounds slope * position "
                         "to bfloat16 and its eager attention adds the bias twice (eager and sdpa disagree)")
    qkv_groups(module)  # raises on a variant transformers cannot run


def _check_bloom(module: Any, config: Any) -> None:
    """BLOOM: ``pretraining_tp > 1`` with ``slow_but_exact`` sums the output projection per
    tensor-parallel slice and drops ``dense``'s bias; that computation is refused."""
    tp, slow = module.pretraining_tp, module.slow_but_exact
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TypeError(f"pretraining_tp must be an int >= 1, got {type(tp).__name__} {tp!r}")
    if not isinstance(slow, bool):
        raise TypeError(f"slow_but_exact must be true or false, got {type(slow).__name__} {slow!r}")
    if tp > 1 and slow:
        raise ValueError(f"pretraining_tp={tp} with slow_but_exact=True is not supported: transformers then sums "
                         "dense per tensor-parallel slice without dense's bias")
    if module.beta != 1.0:
        raise ValueError(f"beta={module.beta!r} scales the ALiBi bias; only 1.0 is supported")


_FUSED_QKV = [
    AttentionSpec("transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXAttention", ("gpt_neox",), "qkv-grouped",
                  "gpt_neox", {"query_key_value": "Linear", "dense": "Linear"},
                  {"": frozenset({"attention_dropout", "config", "head_size", "is_causal", "layer_idx", "rotary_ndims",
                                  "scaling"})}, rope="half", partial_rotary=True, check=_check_gpt_neox),
    AttentionSpec("transformers.models.falcon.modeling_falcon.FalconAttention", ("falcon",), "qkv-grouped", "falcon",
                  {"query_key_value": "FalconLinear", "dense": "FalconLinear", "attention_dropout": "Dropout"},
                  {"": frozenset({"beta", "config", "head_dim", "hidden_dropout", "hidden_size", "inv_norm_factor",
                                  "is_causal", "layer_idx", "max_position_embeddings", "multi_query",
                                  "new_decoder_architecture", "num_heads", "num_kv_heads", "split_size"})},
                  rope="half", check=_check_falcon),
    AttentionSpec("transformers.models.bloom.modeling_bloom.BloomAttention", ("bloom",), "qkv-grouped", "bloom",
                  {"query_key_value": "Linear", "dense": "Linear", "attention_dropout": "Dropout"},
                  {"": frozenset({"beta", "head_dim", "hidden_dropout", "hidden_size", "inv_norm_factor", "layer_idx",
                                  "num_heads", "pretraining_tp", "slow_but_exact", "split_size"})},
                  alibi=True, config_free=True, check=_check_bloom),
]


# ---- out_proj and DistilBERT families (issue #15 item 8): CLIP, OPT, BART, mBART, Whisper, DistilBERT ----
# Read in transformers 5.24: q/k/v_proj + out_proj, no position encoding inside attention.
# CLIP scales by ``scale``; OPT and Whisper multiply q by ``scaling`` before q·kᵀ
# (BART after): the same logits up to rounding, bit-equal where the scale is a power of two.
# BART, mBART and Whisper learn at call time whether they cross-attend (``key_value_states``).
_OUT_PROJ = {n: "Linear" for n in ("q_proj", "k_proj", "v_proj", "out_proj")}
_CLIP_ATTRS = frozenset({"config", "dropout", "embed_dim", "head_dim", "is_causal", "num_heads", "scale"})
_SEQ2SEQ_ATTRS = frozenset({"config", "dropout", "embed_dim", "head_dim", "is_causal", "is_decoder", "layer_idx",
                            "num_heads", "scaling"})


#: (module, class prefix, model type) of the classes that are BART's attention verbatim. BioGPT is
#: a decoder-only LM (causal self-attention only); M2M100's config is NLLB's too. Not here, though
#: their decoder's class is BART's too: PEGASUS-X and BigBird-Pegasus (their encoders' global-local
#: and block-sparse attention are not described, so the models are refused), PP-FormulaNet (its
#: SAM-style vision attention with relative positions).
_BART_COPIES = [("pegasus", "Pegasus", "pegasus"), ("marian", "Marian", "marian"), ("plbart", "PLBart", "plbart"),
                ("m2m_100", "M2M100", "m2m_100"), ("blenderbot", "Blenderbot", "blenderbot"),
                ("blenderbot_small", "BlenderbotSmall", "blenderbot-small"), ("biogpt", "BioGpt", "biogpt"),
                # BART's computation, the source reworded: NLLB-MoE writes k/v_proj(...).view(...) on one
                # line; Speech2Text also takes output_attentions=False and passes it on to the kernel, which
                # ignores it (eager_attention_forward is BART's, its weights are returned either way).
                ("nllb_moe", "NllbMoe", "nllb-moe"), ("speech_to_text", "Speech2Text", "speech_to_text"),
                # time-series encoder-decoders, verbatim; Informer's default ProbSparse attention
                # (attention_type="prob") is another class, not described: refused by name
                ("time_series_transformer", "TimeSeriesTransformer", "time_series_transformer"),
                ("informer", "Informer", "informer")]


def _out_proj(module: str, cls: str, model_types: tuple[str, ...], call: str, attrs: frozenset[str],
              **kw: Any) -> AttentionSpec:
    return AttentionSpec(f"transformers.models.{module}.modeling_{module}.{cls}", model_types, "out_proj", call,
                         _OUT_PROJ, {"": attrs}, **kw)


_OUT_PROJ_FAMILIES = [
    # CLIP's text tower is causal through the is_causal=True its encoder passes (module.is_causal is False)
    _out_proj("clip", "CLIPAttention", ("clip_text_model", "clip_vision_model"), "clip", _CLIP_ATTRS),
    # SigLIP: CLIP's layout and attributes, always bidirectional (is_causal False, the text tower
    # too); forward(hidden_states, attention_mask=None, **kwargs) drops the keywords (an is_causal
    # among them is ignored), so it takes ViT's call, not CLIP's. Its vision tower's pooling head is
    # left alone by name (LEFT_ALONE below).
    _out_proj("siglip", "SiglipAttention", ("siglip_text_model", "siglip_vision_model"), "vit", _CLIP_ATTRS),
    _out_proj("opt", "OPTAttention", ("opt",), "opt",
              frozenset({"config", "dropout", "embed_dim", "enable_bias", "head_dim", "is_causal", "layer_idx",
                         "num_heads", "scaling"})),
    _out_proj("bart", "BartAttention", ("bart",), "bart", _SEQ2SEQ_ATTRS, cross_attention=True),
    _out_proj("mbart", "MBartAttention", ("mbart",), "bart", _SEQ2SEQ_ATTRS, cross_attention=True),
    _out_proj("whisper", "WhisperAttention", ("whisper",), "bart", _SEQ2SEQ_ATTRS, cross_attention=True),
    # BART's copies ("Copied from ... BartAttention"): __init__, forward and the module's
    # eager_attention_forward are BART's source line for line (the class prefix aside), read in
    # transformers 5.24; their models differ outside attention only (positions, embeddings, norms).
    *(_out_proj(module, f"{prefix}Attention", (model_type,), "bart", _SEQ2SEQ_ATTRS, cross_attention=True)
      for module, prefix, model_type in _BART_COPIES),
    # Wav2Vec2: BART's computation without a cache (no layer_idx; never given one: its encoder
    # layers call it with hidden_states and attention_mask only) and with output_attentions passed
    # on to the kernel, which ignores it (as Speech2Text's)
    _out_proj("wav2vec2", "Wav2Vec2Attention", ("wav2vec2",), "bart", _SEQ2SEQ_ATTRS - {"layer_idx"},
              cross_attention=True),
    AttentionSpec("transformers.models.distilbert.modeling_distilbert.DistilBertSelfAttention", ("distilbert",),
                  "distilbert", "clip",
                  {"q_lin": "Linear", "k_lin": "Linear", "v_lin": "Linear", "out_lin": "Linear", "dropout": "Dropout"},
                  {"": frozenset({"attention_head_size", "config", "dim", "is_causal", "n_heads", "scaling"})}),
]

#: Classes whose name says attention but that hold no transformers attention class, only torch's
#: own ``nn.MultiheadAttention``: outside :func:`multihead.hf.patch`'s scope (transformers'
#: attention classes), left as they are (computing exactly what they did), with the reason.
#: Convert their torch module yourself with :meth:`multihead.MultiHeadAttention.from_torch`.
LEFT_ALONE: Mapping[str, str] = {
    "transformers.models.siglip.modeling_siglip.SiglipMultiheadAttentionPoolingHead":
        "SigLIP's vision pooling head: a learned probe attends with torch.nn.MultiheadAttention "
        "(torch's module, not transformers'), then LayerNorm and MLP; left unpatched",
    "transformers.models.siglip2.modeling_siglip2.Siglip2MultiheadAttentionPoolingHead":
        "SigLIP 2's vision pooling head: SigLIP's, with the padding mask passed to torch.nn.MultiheadAttention; "
        "left unpatched",
}

# ---- DeepSeek-V2/V3: multi-head latent attention (issue #15) -------------------------------
# transformers 5.24, modeling_deepseek_v{2,3}.py, read line by line. Both classes compute the
# same thing: q = q_proj(x) or q_b_proj(RMSNorm(q_a_proj(x))); [c | k_rot] = kv_a_proj_with_mqa(x),
# c = RMSNorm(c) (eps fixed at 1e-6, not config.rms_norm_eps); RoPE on q_rot and k_rot; the cache
# holds (c, k_rot); keys [kv_b_proj(c)_nope | k_rot] and values kv_b_proj(c)_v for all H heads;
# softmax(scaling · q·k + mask) v; o_proj. They differ in RoPE only: V2 multiplies complex pairs
# (2p, 2p+1) in float32 (interleaved, always); V3 applies interleaved pairs when
# config.rope_interleave is true and rotate-half otherwise (False or None). The attention kernel
# repeats K/V by num_attention_heads // num_key_value_heads although kv_b_proj already gives H
# heads: the two must be equal (else HF's eager path fails on the shapes, and its sdpa path works
# only where it skips the repeat). scaling = Dq^-0.5 · mscale(factor, mscale_all_dim)² for a
# non-default rope_type (read from the module); the rotary attention factor (yarn's mscale /
# mscale_all_dim) is in our RoPE tables. The pairing is read with the sizes by
# hf_layers._deepseek (AttentionConfig.rope_interleaved); `rope` below describes it.
_DEEPSEEK_NORM_ATTRS = frozenset({"variance_epsilon"})
_DEEPSEEK_Q = ({"q_proj": "Linear"},
               {"q_a_proj": "Linear", "q_a_layernorm": "{v}RMSNorm", "q_b_proj": "Linear"})
_DEEPSEEK_ATTRS = frozenset({"attention_dropout", "config", "hidden_size", "is_causal", "kv_lora_rank", "layer_idx",
                             "num_heads", "num_key_value_groups", "q_lora_rank", "qk_head_dim", "qk_nope_head_dim",
                             "qk_rope_head_dim", "scaling", "v_head_dim",
                             # the query path not taken is set to None (a plain attribute)
                             "q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj"})


def _deepseek(version: int, rope: str, also: tuple[str, ...] = ()) -> AttentionSpec:
    v = f"DeepseekV{version}"
    return AttentionSpec(
        f"transformers.models.deepseek_v{version}.modeling_deepseek_v{version}.{v}Attention",
        (f"deepseek_v{version}", *also), "latent", "latent",
        {"kv_a_proj_with_mqa": "Linear", "kv_a_layernorm": f"{v}RMSNorm", "kv_b_proj": "Linear", "o_proj": "Linear"},
        {"": _DEEPSEEK_ATTRS, "kv_a_layernorm": _DEEPSEEK_NORM_ATTRS, "q_a_layernorm": _DEEPSEEK_NORM_ATTRS},
        rope=rope, alternatives=tuple({k: c.format(v=v) for k, c in alt.items()} for alt in _DEEPSEEK_Q),
        config_equal=(("num_key_value_heads", "num_attention_heads"),))


# SarvamMLA's model holds DeepseekV3Attention itself, with a config of V3's keys (its own type)
_DEEPSEEK = [_deepseek(2, "interleaved"), _deepseek(3, "rope_interleave", also=("sarvam_mla",))]
# ---- end DeepSeek ------------------------------------------------------------------------


# ---- Llama 4 text attention (transformers 5.24, modeling_llama4.py, read line by line) -------------
# Llama4TextAttention: q/k/v/o_proj (bias from attention_bias), use_rope = config.no_rope_layers[layer_idx].
# RoPE layers: interleaved RoPE (complex pairs (2p, 2p+1), float32), then, where the module holds
# qk_norm (config.use_qk_norm), Llama4TextL2Norm: a weightless RMS norm over D (eps rms_norm_eps) of
# the rotated q and k. No-RoPE layers with attn_temperature_tuning: q scaled by
# log1p(floor((p + 1) / floor_scale)) · attn_scale + 1 at the cache positions p (the cache's length +
# 0 .. S-1: one row of positions for the batch, left padding counted). Its model masks each layer by
# config.layer_types[layer_idx]: "chunked_attention" (the default of RoPE layers) causally inside
# chunks of attention_chunk_size tokens counted from each row's first real token
# (create_chunked_causal_mask); "full_attention" causally. The wrapper (call "llama4", in hf_wrappers)
# computes both; a converted layer alone has no temperature tuning (refused: `alone`) and takes its
# chunks from the caller's mask, as the HF module takes them from its model's.
def _llama4_rope(module: Any, config: Any) -> bool:
    """Llama 4: RoPE where ``use_rope`` (``config.no_rope_layers[layer_idx]``, 1 or 0) holds."""
    use = module.use_rope
    if not isinstance(use, (bool, int)) or use not in (0, 1):
        raise TypeError(f"Llama4TextAttention.use_rope (config.no_rope_layers) must be 0 or 1, got {use!r}")
    return bool(use)


def llama4_chunk(module: Any, config: Any) -> int | None:
    """The chunk size (tokens) a Llama 4 layer attends within, or None where it attends fully causally.

    Raises:
        ValueError: ``config.layer_types[layer_idx]`` neither ``"chunked_attention"`` nor
            ``"full_attention"``, or a chunked layer without a positive ``attention_chunk_size``.
    """
    kinds, idx = hf_config.field(config, "layer_types"), module.layer_idx
    if not isinstance(kinds, (list, tuple)) or not isinstance(idx, int) or not 0 <= idx < len(kinds):
        raise ValueError(f"config.layer_types must hold layer_idx={idx!r}, got {kinds!r:.80}")
    if kinds[idx] == "full_attention":
        return None
    if kinds[idx] != "chunked_attention":
        raise ValueError(f"config.layer_types[{idx}]={kinds[idx]!r} is not supported (only 'chunked_attention' "
                         "or 'full_attention')")
    size = hf_config.field(config, "attention_chunk_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"config.attention_chunk_size must be a positive int for a chunked layer, got {size!r}")
    return size


def llama4_temperature(module: Any, config: Any) -> tuple[float, float] | None:
    """``(floor_scale, attn_scale)`` where a Llama 4 layer scales its queries by position (a no-RoPE
    layer with ``attn_temperature_tuning``), else None.

    Raises:
        TypeError: ``attn_temperature_tuning`` is not a bool.
        ValueError: ``floor_scale`` is not a positive number or ``attn_scale`` not a finite one.
    """
    tuning = module.attn_temperature_tuning
    if not isinstance(tuning, bool):
        raise TypeError(f"attn_temperature_tuning must be true or false, got {type(tuning).__name__} {tuning!r}")
    if not tuning or _llama4_rope(module, config):
        return None
    floor, scale = module.floor_scale, module.attn_scale
    for key, value, low in (("floor_scale", floor, 0.0), ("attn_scale", scale, -math.inf)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < math.inf:
            raise ValueError(f"config.{key} must be a {'positive' if low == 0.0 else 'finite'} number, got {value!r}")
    return float(floor), float(scale)


def _check_llama4(module: Any, config: Any) -> None:
    """Llama 4: a layer type and a temperature its wrapper computes."""
    llama4_chunk(module, config)
    llama4_temperature(module, config)


def _llama4_alone(module: Any, config: Any) -> None:
    """A converted Llama 4 layer alone: refused where the class scales q by position."""
    if llama4_temperature(module, config) is not None:
        raise ValueError(f"Llama4TextAttention layer {module.layer_idx}: attn_temperature_tuning=True scales this "
                         "no-RoPE layer's queries by their cache positions, which a MultiHeadAttention alone does "
                         "not; patch the model (multihead.hf.patch), whose wrapper computes it")


_LLAMA4 = AttentionSpec(
    "transformers.models.llama4.modeling_llama4.Llama4TextAttention", ("llama4_text",), "q_proj", "llama4", _LINEARS,
    {"": _LLAMA_ATTRS | {"attn_scale", "attn_temperature_tuning", "floor_scale", "num_attention_heads",
                         "num_key_value_heads", "use_rope"}, "qk_norm": frozenset({"eps"})},
    rope="interleaved", qk_norm="head_after_rope", norm_names=("qk_norm", "qk_norm"), norm_weight=False,
    alternatives=({"qk_norm": "Llama4TextL2Norm"}, {}), rope_on=_llama4_rope, check=_check_llama4,
    alone=_llama4_alone, notes=("chunked attention (`config.layer_types`)", "temperature tuning (no-RoPE layers)"))
# ---- end Llama 4 ---------------------------------------------------------------------------------------


# ---- Llama / Qwen3 / OLMo 2 / Cohere copies and near-copies (transformers 5.24, read line by line) ----
def _check_default_rope(module: Any, config: Any) -> None:
    """PhiMoE: a ``rope_type`` other than ``"default"`` multiplies cos/sin by the config's
    ``short_mscale`` / ``long_mscale`` (chosen by the sequence length), not the type's own factor."""
    params = hf_config.rope_parameters(config.to_dict() if hasattr(config, "to_dict") else config, None,
                                       f"{type(module).__name__} config")
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_parameters rope_type={rope_type!r} is not supported (PhimoeRotaryEmbedding scales "
                         "cos/sin by short_mscale / long_mscale by sequence length); only 'default'")


def _check_partial_rotary(module: Any, config: Any) -> None:
    """Phi, StableLM, GLM: ``int(D · partial_rotary_factor)`` dims rotate, an even count, the
    module's ``rotary_ndims`` where it has one (its RoPE table is sized by the config)."""
    _, _, factor = hf_config.module_rope(config, None, f"{type(module).__name__} config", partial=True)
    rotary = int(module.head_dim * factor)
    ndims = getattr(module, "rotary_ndims", rotary)
    if rotary % 2 or rotary != ndims or rotary < 2:
        raise ValueError(f"partial_rotary_factor={factor} rotates {rotary} of {module.head_dim} dims (module "
                         f"rotary_ndims={ndims}); only an even count >= 2 that equals rotary_ndims is supported")


def _smollm3_rope(module: Any, config: Any) -> bool:
    """SmolLM3: ``use_rope = config.no_rope_layers[layer_idx]`` (1: RoPE, 0: none)."""
    use = module.use_rope
    if isinstance(use, bool) or use not in (0, 1):
        raise TypeError(f"SmolLM3Attention.use_rope (config.no_rope_layers) must be 0 or 1, got {use!r}")
    return bool(use)


def _cohere2_rope(module: Any, config: Any) -> bool:
    """Cohere 2: RoPE where ``sliding_window is not None`` (its sliding layers only)."""
    return module.sliding_window is not None


def _cohere2_moe_rope(module: Any, config: Any) -> bool:
    """Cohere 2 MoE: Cohere 2's rule, or ``force_rope`` (a dense layer when
    ``prefix_dense_sliding_window_pattern == 1``)."""
    force = module.force_rope
    if not isinstance(force, bool):
        raise TypeError(f"Cohere2MoeAttention.force_rope must be true or false, got {type(force).__name__} {force!r}")
    return module.sliding_window is not None or force


def _exaone4_rope(module: Any, config: Any) -> bool:
    """EXAONE 4: RoPE where ``sliding_window is None`` (no hybrid attention) or the layer is a
    sliding one (``is_sliding``); its global layers of a hybrid model have none."""
    sliding = module.is_sliding
    if not isinstance(sliding, bool):
        raise TypeError(f"{type(module).__name__}.is_sliding must be true or false, got {type(sliding).__name__} "
                        f"{sliding!r}")
    return module.sliding_window is None or sliding


def _hunyuan_rope_theta(module: Any, config: Any) -> float | None:
    """HunYuan dense: ``rope_type="dynamic"`` with an ``alpha`` is its own NTK-alpha RoPE, a fixed base
    ``rope_theta · alpha^(D / (D - 2))`` (HunYuanDenseV1RotaryEmbedding.compute_ntk_alpha_rope_parameters),
    not transformers' dynamic NTK scaling; None for any other RoPE (read from the config as usual)."""
    params = hf_config.rope_parameters(config.to_dict() if hasattr(config, "to_dict") else config, None,
                                       f"{type(module).__name__} config")
    alpha = params.get("alpha")
    if params.get("rope_type", params.get("type")) != "dynamic" or not alpha:
        return None
    d = int(module.head_dim)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0 or d <= 2:
        raise ValueError(f"rope_parameters alpha must be a positive number with head_dim > 2, got alpha={alpha!r}, "
                         f"head_dim={d}")
    return float(params.get("rope_theta", hf_config.DEFAULT_ROPE_BASE)) * float(alpha) ** (d / (d - 2))


_WINDOWED = frozenset({"sliding_window"})
#: Not here, refused by name: NanoChat. Its q/k RMSNorm after RoPE has no weight (it commutes with
#: the rotation), but its rotate_half is cat(x2, -x1), not cat(-x2, x1): each pair turns by -θ,
#: which no multihead RoPE does (the cache would hold other keys than HF's).
_EXAONE4_ATTRS = frozenset({"hidden_size", "is_sliding", "num_attention_heads", "num_key_value_heads",
                            "sliding_window", "sliding_window_pattern"})
_COPIES = [
    # LlamaAttention line for line, the class prefix aside (their models differ outside attention)
    _q_proj("arcee", "ArceeAttention"),
    # LlamaAttention's source; the model's mask holds config.sliding_window where it is set
    # (PhimoeModel's create_sliding_window_causal_mask). Only the default rope_type: see the check.
    _q_proj("phimoe", "PhimoeAttention", window="config", check=_check_default_rope),
    # GraniteAttention's source (scaling = config.attention_multiplier)
    _q_proj("granitemoe", "GraniteMoeAttention"),
    # Qwen3Attention but for its window: config.sliding_window in every layer (the config sets it
    # to None unless use_sliding_window), no layer_type
    _q_proj("qwen3_moe", "Qwen3MoeAttention", window="module", extra_attrs=_WINDOWED, norm="Qwen3MoeRMSNorm",
            qk_norm="head"),
    # Llama + o_proj's bias from attention_out_bias (read from the weights) + dropout after o_proj
    _q_proj("seed_oss", "SeedOssAttention", extra_attrs=frozenset({"num_attention_heads", "num_key_value_heads",
                                                                   "residual_dropout"}),
            resid_dropout="residual_dropout"),
    # Llama + RMSNorm over D of each head of q and k (after the transpose: the same over D), before RoPE
    _q_proj("apertus", "ApertusAttention", norm="ApertusRMSNorm", qk_norm="head"),
    # Llama with interleaved RoPE: cos/sin's first D/2 frequencies repeated pairwise, pairs (2p, 2p+1)
    # rotated (rotate_half on 0::2 / 1::2), in float32; bias from config.use_bias (the weights);
    # attention_dropout fixed at 0.0
    _q_proj("ernie4_5", "Ernie4_5Attention", rope="interleaved"),
    # Olmo2Attention (q/k RMSNorm over the whole projection) + per-layer window; its RoPE is per
    # layer type (rope_parameters nested by attention_type)
    _q_proj("olmo3", "Olmo3Attention", norm="Olmo3RMSNorm", qk_norm="proj", window="module",
            extra_attrs=frozenset({"attention_type", "sliding_window"}), layer_type_attr="attention_type"),
    # Llama with RoPE only where use_rope (config.no_rope_layers), window where use_sliding_window
    # and the layer is a sliding one (module.sliding_window)
    _q_proj("smollm3", "SmolLM3Attention", window="module", extra_attrs=frozenset({"sliding_window", "use_rope"}),
            rope_on=_smollm3_rope),
    # Verbatim copies (the attention class, apply_rotary_pos_emb, rotate_half, eager_attention_forward
    # and the rotary embedding class equal to the verified family's, the class prefix aside)
    _q_proj("jais2", "Jais2Attention"), _q_proj("granitemoeshared", "GraniteMoeSharedAttention"),
    _q_proj("hyperclovax", "HyperCLOVAXAttention"),  # GraniteAttention's (scaling = attention_multiplier)
    _q_proj("dots1", "Dots1Attention", window="module", extra_attrs=_LAYER_TYPED, norm="Dots1RMSNorm",
            qk_norm="head"),  # Qwen3Attention's
    _q_proj("flex_olmo", "FlexOlmoAttention", norm="FlexOlmoRMSNorm", qk_norm="proj"),  # Olmo2Attention's
    _q_proj("ernie4_5_moe", "Ernie4_5_MoeAttention", rope="interleaved"),  # Ernie4_5Attention's
    _q_proj("hy_v3", "HYV3Attention", norm="HYV3RMSNorm", qk_norm="head"),  # ApertusAttention's
    # ---- partial rotary: the first int(D · partial_rotary_factor) dims rotate, the rest pass ----
    # Phi (1/2): q/k/v_proj with bias + dense; optional per-head nn.LayerNorm on q/k (qk_layernorm)
    # not described: refused; rotate-half on q[..., :rotary_ndims]
    AttentionSpec("transformers.models.phi.modeling_phi.PhiAttention", ("phi",), "dense", "llama",
                  {"q_proj": "Linear", "k_proj": "Linear", "v_proj": "Linear", "dense": "Linear"},
                  {"": _LLAMA_ATTRS | {"qk_layernorm", "rotary_ndims"}}, rope="half", partial_rotary=True,
                  config_must={"qk_layernorm": False}, check=_check_partial_rotary),
    # Persimmon (and Fuyu's language model): BLOOM's fused layout with q/k/v and dense biases,
    # rotate-half RoPE on the first rotary_ndims dims (Phi's partial rotary), causal; its optional
    # per-head nn.LayerNorm on q and k (qk_layernorm) not described: refused
    AttentionSpec("transformers.models.persimmon.modeling_persimmon.PersimmonAttention", ("persimmon",),
                  "qkv-grouped", "llama",
                  {"query_key_value": "Linear", "dense": "Linear", "attention_dropout": "Dropout"},
                  {"": frozenset({"config", "head_dim", "hidden_size", "is_causal", "layer_idx", "num_heads",
                                  "qk_layernorm", "rotary_ndims", "scaling"})},
                  rope="half", partial_rotary=True, config_must={"qk_layernorm": False},
                  check=_check_partial_rotary),
    # StableLM: Phi's rotation with q/k/v bias from use_qkv_bias and o_proj without; its optional
    # per-head LayerNorm (qk_layernorm, StableLmLayerNormPerHead) not described: refused
    _q_proj("stablelm", "StableLmAttention", partial_rotary=True, config_must={"qk_layernorm": False},
            extra_attrs=frozenset({"hidden_size", "num_heads", "num_key_value_heads", "qk_layernorm",
                                   "rotary_ndims"}), check=_check_partial_rotary),
    # GLM / GLM-4 (the same class source): Llama's with o_proj without bias, RoPE in interleaved
    # pairs (2p, 2p + 1) on the first R = int(D · partial_rotary_factor) dims (cos/sin's first R/2
    # frequencies repeated pairwise, R the width of GlmRotaryEmbedding's table), the rest passed
    _q_proj("glm", "GlmAttention", rope="interleaved", partial_rotary=True, check=_check_partial_rotary),
    _q_proj("glm4", "Glm4Attention", rope="interleaved", partial_rotary=True, check=_check_partial_rotary),
    # CohereAttention without use_qk_norm; RoPE (interleaved) and window in the sliding layers only
    _q_proj("cohere2", "Cohere2Attention", rope="interleaved", window="module", extra_attrs=_WINDOWED,
            rope_on=_cohere2_rope),
    # Cohere 2's, with RoPE also where force_rope (its dense prefix layers)
    _q_proj("cohere2_moe", "Cohere2MoeAttention", rope="interleaved", window="module",
            extra_attrs=_WINDOWED | {"force_rope"}, rope_on=_cohere2_moe_rope),
    # ModernBERT: bidirectional; fused Wqkv rows [q | k | v] (view(..., 3, H, D)) + Wo, then out_drop
    # (nn.Dropout(attention_dropout), or nn.Identity at 0); rotate-half RoPE with each layer type's
    # rope_parameters (config.layer_types[layer_idx]); scale D^-0.5 (no scaling attribute); local
    # layers: module.sliding_window = config.sliding_window + 1, which HF's bidirectional mask
    # holds as |i - j| <= config.sliding_window, our window's |i - j| < window
    AttentionSpec("transformers.models.modernbert.modeling_modernbert.ModernBertAttention", ("modernbert",), "wqkv",
                  "llama", {"Wqkv": "Linear", "Wo": "Linear"},
                  {"": frozenset({"attention_dropout", "config", "deterministic_flash_attn", "head_dim", "is_causal",
                                  "layer_idx", "sliding_window"})},
                  rope="half", window="module", resid_dropout="attention_dropout",
                  alternatives=({"out_drop": "Identity"}, {"out_drop": "Dropout"}),
                  layer_type_attr=CONFIG_LAYER_TYPE),
    # Mellum: Qwen3-MoE's attention with module.sliding_window set in its sliding layers only; its
    # model picks each layer's RoPE by config.layer_types[layer_idx] (rope_parameters per layer type)
    _q_proj("mellum", "MellumAttention", window="module", extra_attrs=_WINDOWED, norm="MellumRMSNorm",
            qk_norm="head", layer_type_attr=CONFIG_LAYER_TYPE),
    # GLM-4 MoE: Llama's with GLM's partial rotary in rotate-half pairs (the first
    # int(D · partial_rotary_factor) dims, as Phi); its optional per-head q/k RMSNorm (use_qk_norm)
    # not described: refused. SarvamMoE's model holds this class with its own config type.
    _q_proj("glm4_moe", "Glm4MoeAttention", also=("sarvam_moe",), partial_rotary=True, check=_check_partial_rotary,
            extra_attrs=frozenset({"rope_parameters", "use_qk_norm"}), config_must={"use_qk_norm": False}),
    # EXAONE 4: Llama + Qwen3's per-head q/k RMSNorm before RoPE; module.sliding_window is
    # config.sliding_window in every layer, passed to the kernel only where is_sliding; RoPE only
    # where sliding_window is None or is_sliding (its hybrid models' global layers have none)
    _q_proj("exaone4", "Exaone4Attention", norm="Exaone4RMSNorm", qk_norm="head", window="is_sliding",
            extra_attrs=_EXAONE4_ATTRS, rope_on=_exaone4_rope),
    # HunYuan dense: Llama's (bias on all four from attention_bias) with per-head RMSNorm over D of
    # q and k AFTER RoPE (query_layernorm, key_layernorm: Llama's RMSNorm, weight of D)
    _q_proj("hunyuan_v1_dense", "HunYuanDenseV1Attention", norm="HunYuanDenseV1RMSNorm", qk_norm="head_after_rope",
            norm_names=("query_layernorm", "key_layernorm"), rope_theta=_hunyuan_rope_theta),
    # EXAONE 4's attention verbatim (its model's MoE aside)
    _q_proj("exaone_moe", "ExaoneMoeAttention", norm="ExaoneMoeRMSNorm", qk_norm="head", window="is_sliding",
            extra_attrs=_EXAONE4_ATTRS, rope_on=_exaone4_rope),
]

# ---- Qwen-VL text attention with M-RoPE (transformers 5.24, read line by line) ---------------------
#: M-RoPE's ``rope`` kinds: (slot layout, the sections the class's rotary embedding uses where
#: ``rope_parameters`` has no ``mrope_section``); :class:`multihead.mrope.MRoPE` computes them.
MROPE_KINDS: Mapping[str, tuple[str, tuple[int, int, int]]] = {
    "mrope": ("chunked", (16, 24, 24)),  # Qwen2VLRotaryEmbedding, Qwen2_5_VLRotaryEmbedding
    "mrope_interleaved": ("interleaved", (24, 20, 20)),  # Qwen3VL(Moe)TextRotaryEmbedding
}


def _check_mrope(module: Any, config: Any) -> None:
    """Qwen-VL text attention: the model's rotary table (sized by ``config.head_dim`` or E / H) is
    as wide as the module's heads, and ``mrope_section`` assigns every frequency slot to a row."""
    from ..mrope import slot_rows

    spec = spec_of(module)
    kind = None if spec is None or spec.rope is None else MROPE_KINDS.get(spec.rope)
    if spec is None or kind is None:  # called from an M-RoPE entry only
        raise ValueError(f"{type(module).__name__} is not described with M-RoPE")
    src = f"{spec.name} config"
    table = hf_config.field(config, "head_dim") or (hf_config.field(config, "hidden_size")
                                                    // hf_config.field(config, "num_attention_heads"))
    if table != module.head_dim:
        raise ValueError(f"config.head_dim={table!r} differs from the module's head_dim={module.head_dim}: "
                         "transformers' M-RoPE table and attention would disagree")
    layout, default = kind
    _, _, factor = hf_config.module_rope(config, None, src)  # a partial rotary factor is refused here
    slot_rows(hf_config.module_mrope_sections(config, default, src), layout, int(module.head_dim * factor) // 2)


#: Qwen2-VL's text attention (Qwen2.5-VL's is the same source): Qwen2's (q/k/v biases, o_proj without,
#: head_dim = E / H, window where the layer type slides) with M-RoPE: the text model's rotary embedding
#: takes (3, B, S) positions and rope_parameters["mrope_section"]; the wrapper reads those positions
#: (multihead.interop.hf_mrope), not the cos/sin the decoder layer hands over.
_QWEN_VL_ATTRS = frozenset({"hidden_size", "num_heads", "num_key_value_heads", "rope_parameters", "layer_type",
                            "sliding_window"})
_QWEN_VL = [
    _q_proj("qwen2_vl_text", "Qwen2VLAttention", module="qwen2_vl", rope="mrope", window="module",
            extra_attrs=_QWEN_VL_ATTRS, call="mrope", check=_check_mrope),
    _q_proj("qwen2_5_vl_text", "Qwen2_5_VLAttention", module="qwen2_5_vl", rope="mrope", window="module",
            extra_attrs=_QWEN_VL_ATTRS, call="mrope", check=_check_mrope),
    # Qwen3-VL's text attention (its MoE model's is the same source): Qwen3's (per-head q/k RMSNorm
    # before RoPE, biases from attention_bias, no window) with M-RoPE in the interleaved layout
    *(_q_proj(t, f"{c}TextAttention", module=t[:-5], rope="mrope_interleaved", extra_attrs=frozenset({"layer_type"}),
              call="mrope", norm=f"{c}TextRMSNorm", qk_norm="head", check=_check_mrope)
      for t, c in (("qwen3_vl_text", "Qwen3VL"), ("qwen3_vl_moe_text", "Qwen3VLMoe"))),
    # Cosmos3-Edge's text attention: Llama's verbatim, its model's rotary embedding Qwen3-VL's
    # interleaved M-RoPE (the same source); described as Llama's copy, it rotated an image's
    # batch by 1-D positions (tests/interop/test_kernel_zoo.py compares it with an image)
    _q_proj("cosmos3_edge_text", "Cosmos3EdgeTextAttention", module="cosmos3_edge", rope="mrope_interleaved",
            call="mrope", check=_check_mrope),
]


#: The classes described here, keyed by their qualified names.
_DESCRIBED: Mapping[str, AttentionSpec] = {s.cls: s for s in [
    _q_proj("llama", "LlamaAttention", also=("exaone", "internlm3", "iquestcoder")),  # their models are Llama
    _q_proj("mistral", "MistralAttention", window="config"),
    _q_proj("mixtral", "MixtralAttention", window="config"),
    _q_proj("qwen2", "Qwen2Attention", window="module", extra_attrs=frozenset({"layer_type", "sliding_window"})),
    _q_proj("gemma", "GemmaAttention"),
    _q_proj("granite", "GraniteAttention"),
    _q_proj("olmo", "OlmoAttention", config_must={"clip_qkv": None}),
    _q_proj("starcoder2", "Starcoder2Attention", window="config", extra_attrs=frozenset({"residual_dropout"}),
            resid_dropout="residual_dropout"),
    _q_proj("cohere", "CohereAttention", rope="interleaved", extra_attrs=frozenset({"use_qk_norm"}),
            config_must={"use_qk_norm": False}),
    _q_proj("qwen3", "Qwen3Attention", window="module", extra_attrs=_LAYER_TYPED, norm="Qwen3RMSNorm",
            qk_norm="head"),
    _q_proj("olmo2", "Olmo2Attention", norm="Olmo2RMSNorm", qk_norm="proj"),
    _q_proj("gemma2", "Gemma2Attention", window="module", softcap=True,
            extra_attrs=_LAYER_TYPED | {"attn_logit_softcapping"}),
    _q_proj("gemma3_text", "Gemma3Attention", module="gemma3", window="module", softcap=True,
            extra_attrs=_LAYER_TYPED | {"attn_logit_softcapping", "is_sliding"}, norm="Gemma3RMSNorm",
            qk_norm="head", norm_offset=True, config_must={"use_bidirectional_attention": False}),
    AttentionSpec("transformers.models.phi3.modeling_phi3.Phi3Attention", ("phi3",), "phi3", "llama",
                  {"qkv_proj": "Linear", "o_proj": "Linear"},
                  {"": _LLAMA_ATTRS | {"num_key_value_heads"}}, rope="half", window="config", partial_rotary=True),
    _q_proj("gpt_oss", "GptOssAttention", window="module", extra_attrs=_LAYER_TYPED, params=frozenset({"sinks"})),
    AttentionSpec("transformers.models.vit.modeling_vit.ViTAttention", ("vit",), "q_proj", "vit", _LINEARS,
                  {"": frozenset({"attention_dropout", "config", "head_dim", "is_causal", "num_attention_heads",
                                  "scaling"})}),
    _GPT2,
    *_bert("bert", "Bert", also=("dpr",)), *_bert("roberta", "Roberta"), *_bert("xlm-roberta", "XLMRoberta"),
    *_bert("electra", "Electra"),
    # LayoutLM: BERT's attention in its encoder-only form (no cache: an encoder); the 2-D position
    # embeddings are outside attention
    *_bert("layoutlm", "LayoutLM", encoder=True),
    *_FUSED_QKV,
    *_OUT_PROJ_FAMILIES,
    *_DEEPSEEK,
    *_QWEN_VL,
    *_COPIES,
    _LLAMA4,
]}
#: Every supported class, keyed by its qualified name: those described here and their copies
#: (:mod:`multihead.interop.hf_copies`, each described by its original's entry).
def _copies(described: Mapping[str, AttentionSpec]) -> dict[str, AttentionSpec]:
    """Each copy's entry (:data:`hf_copies.COPIES`), keyed by its qualified name: its original's with
    the copy's class, model types, part classes (the original's class prefix replaced by the
    copy's) and extra attributes; ``copy_of`` records the original's name.

    Raises:
        KeyError: a copy whose original is not described here (a mistake in the table).
    """
    out = {}
    for copy in hf_copies.COPIES:
        base = described[copy.original]
        old, new = hf_copies.class_prefix(base.name), hf_copies.class_prefix(copy.cls)

        def rename(parts: Mapping[str, str], old: str = old, new: str = new) -> dict[str, str]:
            return {path: cls.replace(old, new, 1) if cls.startswith(old) else cls for path, cls in parts.items()}

        attrs = {path: allowed | copy.attrs if path == "" else allowed for path, allowed in base.attrs.items()}
        out[copy.qualified] = dataclasses.replace(
            base, cls=copy.qualified, model_types=copy.model_types, parts=rename(base.parts), attrs=attrs,
            alternatives=tuple(rename(group) for group in base.alternatives), copy_of=base.name)
    return out


REGISTRY: Mapping[str, AttentionSpec] = {**_DESCRIBED, **_copies(_DESCRIBED)}


def qualified_name(module: nn.Module) -> str:
    """``module``'s class as ``package.module.Class`` (the registry's key)."""
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def spec_of(module: nn.Module) -> AttentionSpec | None:
    """The registry entry of ``module``'s exact class, or None (subclasses are not entries)."""
    return REGISTRY.get(qualified_name(module))


def require_spec(module: nn.Module, config: Any | None = None) -> AttentionSpec:
    """``module``'s description when it covers the module; ValueError with :func:`why_not`'s reason."""
    reason = why_not(module, config)
    spec = spec_of(module)
    if reason is not None or spec is None:
        raise ValueError(reason)
    return spec


def why_not(module: nn.Module, config: Any | None = None) -> str | None:
    """Why ``module`` cannot be converted exactly, or None when its description covers it.

    Checks, in order: the class is registered; its ``is_cross_attention`` attribute, where
    it has one, is off (classes that cross-attend at call time, BART's, are described with
    ``cross_attention``); its submodules are exactly the described ones (paths and
    classes); every plain attribute is described; the config's model type is verified; the
    config keys in ``config_must`` hold the covered values.
    """
    spec = spec_of(module)
    if spec is None:
        return (f"{type(module).__name__} is not a supported attention class ({qualified_name(module)}); "
                f"supported: {', '.join(sorted(s.name for s in REGISTRY.values()))}")
    if getattr(module, "is_cross_attention", False):
        return f"{spec.name} is a cross-attention (is_cross_attention=True): not supported"
    parts = {name: type(m).__name__ for name, m in module.named_modules() if name}
    described = _described_parts(spec, parts)
    extra = sorted(f"{n} ({c})" for n, c in parts.items() if described.get(n) != c)
    missing = sorted(set(described) - set(parts))
    if extra or missing:
        return (f"{spec.name} has submodules its description does not account for: "
                f"{', '.join(extra) or 'none'}; missing: {', '.join(missing) or 'none'}")
    own = sorted(set(module._parameters) - spec.params)
    if own:
        return f"{spec.name} has parameters of its own its description does not cover: {own}"
    for path, allowed in spec.attrs.items():
        if path and path not in parts:
            continue  # an alternative part that is absent (checked above)
        owner = module.get_submodule(path) if path else module
        unknown = sorted(k for k in vars(owner) if not k.startswith("_") and k != "training" and k not in allowed)
        if unknown:
            return f"{spec.name}{'.' + path if path else ''} has attributes its description does not cover: {unknown}"
    config = config if config is not None else _config_of(module)
    model_type = hf_config.field(config, "model_type") if config is not None else None
    if model_type not in spec.model_types and not (spec.config_free and config is None):
        # Another config class may hold other keys (RoPE, windows) under other names.
        return (f"{spec.name} with a config of model_type={model_type!r} is not verified; "
                f"verified: {', '.join(spec.model_types)}")
    for key, want in spec.config_must.items():
        got = hf_config.field(config, key) if config is not None else None
        if got != want:
            return f"{spec.name} with config.{key}={got!r} is not supported (only {want!r})"
    for rule in (spec.check, spec.rope_on, spec.rope_theta):
        if rule is None:
            continue
        try:
            rule(module, config)
        except (TypeError, ValueError) as e:
            return f"{spec.name}: {e}"
    for key, other in spec.config_equal:
        got, want = (hf_config.field(config, k) if config is not None else None for k in (key, other))
        if got != want:
            return f"{spec.name} with config.{key}={got!r} != config.{other}={want!r} is not supported"
    return None


def _described_parts(spec: AttentionSpec, parts: Mapping[str, str]) -> Mapping[str, str]:
    """``spec.parts`` plus the alternative group the module holds (the first it holds exactly, else
    the first whose first part it has)."""
    for group in spec.alternatives:
        if all(parts.get(name) == cls for name, cls in group.items()):
            return {**spec.parts, **group}
    for group in spec.alternatives:
        if next(iter(group)) in parts:
            return {**spec.parts, **group}
    return {**spec.parts, **spec.alternatives[0]} if spec.alternatives else spec.parts


def _config_of(module: nn.Module) -> Any | None:
    config = getattr(module, "config", None)
    inner = getattr(module, "self", None)
    return config if config is not None else getattr(inner, "config", None)


def markdown_table() -> str:
    """The docs' table (docs/guides/huggingface.md) of supported families, generated from :data:`REGISTRY`."""
    rows = ["| model type | attention class | layout | position encoding | window | also |",
            "|---|---|---|---|---|---|"]
    for spec in sorted(REGISTRY.values(), key=lambda s: (s.model_types, s.name)):
        if spec.call is None:
            continue  # converted by from_hf as part of its parent's entry
        rope = {None: "none", "half": "RoPE, rotate-half (+ scaling)",
                "interleaved": "RoPE, interleaved (+ scaling)",
                "rope_interleave": "RoPE, as `rope_interleave` (+ scaling)",
                "mrope": "M-RoPE, rotate-half, 3 position rows in sections (+ scaling)",
                "mrope_interleaved": "M-RoPE, rotate-half, 3 position rows interleaved (+ scaling)"}[spec.rope]
        rope = "ALiBi (standard slopes)" if spec.alibi else rope
        rope += ", partial" if spec.partial_rotary else ""
        window = {None: "none", "module": "per layer (`module.sliding_window`)",
                  "is_sliding": "sliding layers (`module.is_sliding`)",
                  "config": "`config.sliding_window`"}[spec.window]
        rope += ", not in every layer" if spec.rope_on is not None else ""
        also = [f"QK-norm ({spec.qk_norm}{'' if spec.norm_weight else ', no weight'})"] if spec.qk_norm else []
        also += ["soft-capping"] if spec.softcap else []
        also += ["sinks"] if "sinks" in spec.params else []
        also += ["cross-attention (encoder-decoder cache)"] if spec.cross_attention else []
        also += ["latent KV (MLA)"] if spec.layout == "latent" else []
        also += [f"copy of `{spec.copy_of}`"] if spec.copy_of else []
        also += list(spec.notes)
        rows.append(f"| {', '.join(spec.model_types)} | `{spec.name}` | {spec.layout} | {rope} | {window} | "
                    f"{', '.join(also) or '-'} |")
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover - prints the docs' table
    print(markdown_table())  # noqa: T201
