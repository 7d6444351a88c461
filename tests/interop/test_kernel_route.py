"""The AttentionInterface route (``attn_implementation="multihead"``): exact, or refused by name.

Notation: B batch, S tokens, H heads, D head_dim.

The kernel (:mod:`multihead.interop.hf_kernel`) accepts a model where transformers lets it run
``"sdpa"`` (``_supports_sdpa``), plus the model types of ``hf_kernel.SDPA_OFF_BUT_COMPUTED``,
and only the keyword arguments it lists. Here, with the eager model as the oracle:

* **every zoo type** (tests/interop/test_zoo.py's ``ZOO``, the eager models built once per
  session by test_every_path.case and shared with it): a deep copy set to the kernel, run on a
  right- and a left-padded batch and through greedy generation, equals eager (relative 1e-5
  on real tokens, the same tokens), or is refused naming the model where transformers refuses
  SDPA; a type transformers lets run SDPA is never refused;
* **the types it computed wrong before** (PEGASUS-X, BigBird-Pegasus, NLLB-MoE, BridgeTower,
  GIT, DeepSeek-V4: relative error 0.05-1.4, or other greedy tokens) are refused by name;
* **the types accepted although transformers keeps them off SDPA** (soft-capping, sinks) are
  exact the same way, on tiny models of their own configs;
* keyword arguments outside the lists are refused naming them; ``cu_seq_lens_q`` is honoured.

Runtime: about a minute on 2 shared cores (most of it the zoo's generation).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.interop import hf_kernel

pytest.importorskip("transformers")
from test_every_path import case  # noqa: E402 - same folder: the zoo's eager models, built once
from test_zoo import RTOL, ZOO, _generate, _inputs, _outs, sharpen, tiny_config  # noqa: E402

NAME = hf_kernel.register()


def _kernel_copy(model: nn.Module) -> nn.Module:
    kernel = copy.deepcopy(model)
    kernel.set_attn_implementation(NAME)
    return kernel


def through_kernel(model: nn.Module, model_type: str, generator: bool, batches: list[dict[str, torch.Tensor]],
                   generate: Any = None) -> str:
    """``"exact"``, ``"wrong: ..."`` or ``"refused: <message>"`` for ``model`` (eager, left
    untouched) set to the kernel, on ``batches`` and (``generator``) through greedy generation."""
    generate = generate or (lambda m: _generate(m, model_type, batches[0]))
    wants = [_outs(model, inputs) for inputs in batches]
    tokens = generate(model) if generator else None
    kernel = _kernel_copy(model)
    try:
        for inputs, want in zip(batches, wants):
            for (got, _), (out, real) in zip(_outs(kernel, inputs), want):
                rel = ((got[real] - out[real]).abs().max() / out[real].abs().max()).item()
                if not rel <= RTOL:
                    return f"wrong: relative difference {rel:.2e} on real tokens"
        if generator and not torch.equal(generate(kernel), tokens):
            return "wrong: different greedy tokens"
    except (ValueError, TypeError) as e:
        return f"refused: {e}"
    return "exact"


def _sdpa_supported(model: nn.Module) -> bool:
    """Whether transformers lets this model class run ``attn_implementation="sdpa"``."""
    return bool(type(model)._supports_sdpa)


@pytest.mark.parametrize("model_type", list(ZOO))
def test_zoo_type_through_the_kernel_equals_eager_or_is_refused_by_name(model_type: str) -> None:
    model = case(model_type).model
    generator = ZOO[model_type][1]
    got = through_kernel(model, model_type, generator, [_inputs(model_type, side) for side in ("right", "left")])
    if _sdpa_supported(model) or model.config.model_type in hf_kernel.SDPA_OFF_BUT_COMPUTED:
        assert got == "exact", got  # never wrong, never over-refused
    elif got != "exact":  # transformers keeps it off SDPA: refused naming its model, unless it never reaches us
        assert got.startswith("refused: ") and "_supports_sdpa=False" in got, got
        assert repr(model.config.model_type) in got, got


# ---- tiny models outside the zoo, from their own configs ------------------------------------------------
B, S, VOCAB = 2, 9, 100
#: Model types AutoModel does not map, built with their own class.
OWN_CLASS = {"bridgetower_text_model": "transformers.models.bridgetower.modeling_bridgetower.BridgeTowerTextModel"}


def _tiny(model_type: str, **extra: Any) -> tuple[nn.Module, bool]:
    """(eager tiny model, generator?): a seq2seq or causal LM where the type has one, else the base model."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)

    auto = (AutoModelForSeq2SeqLM if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
            else AutoModelForCausalLM if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModel)
    config = tiny_config(model_type, **extra)
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model_type in OWN_CLASS:  # a tower AutoModel does not map
            where, _, name = OWN_CLASS[model_type].rpartition(".")
            cls = getattr(importlib.import_module(where), name)
            model = cls._from_config(config, attn_implementation="eager")
        else:
            model = auto.from_config(config, attn_implementation="eager", experts_implementation="eager")
    return sharpen(model.eval()), auto is not AutoModel


def _text_batches(model: nn.Module) -> list[dict[str, torch.Tensor]]:
    """A right- and a left-padded batch of token ids (3 padding tokens in row 2)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (B, S), generator=g)
    batches = []
    for side in ("right", "left"):
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, S - 3:] = 0 if side == "right" else 1
        mask[1, :3] = 0 if side == "left" else 1
        batch = {"input_ids": ids, "attention_mask": mask}
        if model.config.is_encoder_decoder:
            batch.update(decoder_input_ids=ids[:, :7], decoder_attention_mask=mask[:, :7])
        batches.append(batch)
    return batches


def _greedy(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model.generate(batch["input_ids"][:1], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)


#: The types computed wrong before (issue: relative error 0.05-1.4, or DeepSeek-V4's greedy
#: tokens), each with the class transformers marks ``_supports_sdpa = False`` and extra fields.
WRONG_BEFORE = {
    "pegasus_x": ("PegasusXModel", {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
                                    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "block_size": 4,
                                    "num_global_tokens": 2, "decoder_start_token_id": 2}),
    "bigbird_pegasus": ("BigBirdPegasusModel", {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
                                                "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                                                "attention_type": "original_full", "decoder_start_token_id": 2}),
    "nllb-moe": ("NllbMoeModel", ZOO["nllb-moe"][0]),
    "bridgetower_text_model": ("BridgeTowerTextModel", {}),
    "git": ("GitModel", {}),
    "deepseek_v4": ("DeepseekV4Model", {}),
}


@pytest.mark.parametrize("model_type", list(WRONG_BEFORE))
def test_type_computed_wrong_before_is_refused_by_name(model_type: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    assert model_type in CONFIG_MAPPING_NAMES
    cls, extra = WRONG_BEFORE[model_type]
    model, generator = _tiny(model_type, **extra)
    got = through_kernel(model, model_type, generator, _text_batches(model), _greedy_or_seq2seq(model))
    assert got.startswith("refused: ") and cls in got and "_supports_sdpa=False" in got, got


def _greedy_or_seq2seq(model: nn.Module) -> Any:
    if not model.config.is_encoder_decoder:
        return lambda m: _greedy(m, _text_batches(model)[0])
    return lambda m: m.generate(_text_batches(model)[0]["input_ids"][:1], max_new_tokens=4, min_new_tokens=4,
                                do_sample=False, pad_token_id=0, decoder_start_token_id=2)


#: Tiny-config fields for the accepted types outside the zoo.
OWN_FIELDS: dict[str, dict[str, Any]] = {
    "flint": {}, "granite_swa": {}, "granitemoe_swa": {}, "mimo_v2_flash": {}, "vaultgemma": {}, "splinter": {},
}


@pytest.mark.parametrize("model_type", sorted(set(hf_kernel.SDPA_OFF_BUT_COMPUTED) - set(ZOO)))
def test_type_accepted_though_off_sdpa_equals_eager(model_type: str) -> None:
    model, generator = _tiny(model_type, **OWN_FIELDS.get(model_type, {}))
    assert not _sdpa_supported(model)  # else it needs no entry
    got = through_kernel(model, model_type, generator, _text_batches(model), _greedy_or_seq2seq(model))
    assert got == "exact", got


#: Types transformers lets run SDPA whose attention passes keywords the zoo's do not (ModernBERT:
#: ``deterministic``, flash-attn's backward switch, and a bidirectional window).
OUTSIDE_ZOO = ["modernbert"]


@pytest.mark.parametrize("model_type", OUTSIDE_ZOO)
def test_sdpa_type_outside_the_zoo_equals_eager(model_type: str) -> None:
    model, generator = _tiny(model_type)
    assert _sdpa_supported(model)
    assert through_kernel(model, model_type, generator, _text_batches(model), _greedy_or_seq2seq(model)) == "exact"


def test_every_type_accepted_though_off_sdpa_is_compared() -> None:
    compared = set(ZOO) | set(OWN_FIELDS)
    assert set(hf_kernel.SDPA_OFF_BUT_COMPUTED) <= compared


# ---- keyword arguments ------------------------------------------------------------------------------
def _qkv(b: int = 1, s: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(b, 4, s, 8), torch.randn(b, 2, s, 8), torch.randn(b, 2, s, 8)


def test_unknown_keyword_is_refused_naming_it_and_the_class() -> None:
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"Module passed keyword argument\(s\) \['attn_bias'\]"):
        mh.hf.attention_forward(nn.Module(), q, k, v, None, attn_bias=torch.zeros(1, 4, 6, 6))


@pytest.mark.parametrize("name", sorted(hf_kernel.REFUSED_WHEN_SET))
def test_keyword_with_a_meaning_not_computed_is_refused_when_set(name: str) -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=name):
        mh.hf.attention_forward(nn.Module(), q, k, v, None, **{name: torch.ones(1, 4, 6, 6)})
    out, _ = mh.hf.attention_forward(nn.Module(), q, k, v, None, **{name: None})  # None: nothing asked
    torch.testing.assert_close(out.transpose(1, 2), mh.attention(q, k, v))


def test_plumbing_keywords_change_nothing() -> None:
    q, k, v = _qkv()
    plumbing = {name: None for name in hf_kernel.CARRIES_NOTHING} | {"position_ids": torch.arange(6)[None]}
    out, _ = mh.hf.attention_forward(nn.Module(), q, k, v, None, **plumbing)
    torch.testing.assert_close(out.transpose(1, 2), mh.attention(q, k, v), rtol=0, atol=0)


def test_cu_seq_lens_keep_packed_sequences_apart() -> None:
    q, k, v = _qkv(s=7)
    module = nn.Module()
    module.is_causal = True
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out, _ = mh.hf.attention_forward(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4,
                                     max_length_k=4)  # (B, S, H, D)
    parts = [mh.attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True) for a, b in ((0, 3), (3, 7))]
    torch.testing.assert_close(out.transpose(1, 2), torch.cat(parts, dim=2))
    with pytest.raises(ValueError, match="cu_seq_lens"):
        mh.hf.attention_forward(module, *_qkv(b=2, s=7), None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_a_zoo_type_sees_only_listed_keywords() -> None:
    """What transformers passes the kernel in a real model (Llama, generation included) is listed."""
    seen: list[str] = []
    own = set(inspect.signature(hf_kernel.attention_forward).parameters)  # scaling, dropout, ...

    def spy(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        seen.extend(set(kwargs) - own)
        return hf_kernel.attention_forward(module, *args, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register("multihead_spy", spy)
    model = copy.deepcopy(case("llama").model)
    model.set_attn_implementation("multihead_spy")
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionMaskInterface.register("multihead_spy", sdpa_mask)
    _greedy(model, _inputs("llama"))
    assert seen and set(seen) <= set(hf_kernel.HONOURED) | set(hf_kernel.CARRIES_NOTHING), sorted(set(seen))
