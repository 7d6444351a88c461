"""Every attention class of the registry, patched, gives its weights on every path.

Notation: B batch, S tokens (queries), Sk keys, E embed_dim, H query heads, Hkv key/value
heads, D head_dim, P prompt tokens.

The matrix is the zoo (``ZOO`` of tests/interop/test_zoo.py: one tiny random-weight model per
accepted model type, 2 layers, S = 9, built with ``attn_implementation="eager"``, every 2-D
weight ×4). The eager model is the oracle; a patched deep copy must give what it gives:

* ``output_attentions=True``: the same number of tensors (B, H, S, Sk) in each field
  (encoder-decoders: ``encoder_attentions``, ``decoder_attentions``, ``cross_attentions``),
  each equal; decoders (and the time-series encoder-decoders) with ``use_cache`` True and False.
* ``mh.heads.capture`` around a forward (``use_cache`` True and False): ``cap.layers`` names
  every attention layer as the unpatched model does; ``cap.weights`` equal the eager module's
  weights, and each other; ``cap.modules[name].output(cap.heads[name])`` (merge the heads,
  then o_proj) equals the eager module's output projection (its output before any residual).
* ``capture`` around ``generate`` (P = 4 tokens, 3 new, greedy, no padding): one call per step,
  each call's rows appended (weights zero-padded on the right to the longest key count),
  ``k``/``v`` the last call's: equal to captures of the no-cache forward of the tokens each call
  had seen, which for the usual calls (the prefill of P tokens, then one token at a time) is the
  no-cache forward of the first P + 2 tokens. P + 2 stays within the sliding window (6): HF's
  sliding cache keeps the last window - 1 keys only, after which a call's key columns would no
  longer start at position 0.
* a second plain call of a layer inside one capture block is refused.

"Equal": relative difference ≤ 1e-5 (float32, to the tensor's max abs) on the rows of real
queries where the batch is padded: HF's eager gives a fully masked row (a left-padded causal
query) uniform weights, we give zeros.

DeepSeek's latent attention (``layout == "latent"``) may instead refuse weights with a
ValueError naming it (its class, or latent attention); never an empty result.

Runtime: about 40 s on 2 shared cores (one build per model type, shared by its tests).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import multihead as mh
from multihead.interop import hf_registry

pytest.importorskip("transformers")
from test_zoo import (DECODER_STATES, SEQ2SEQ, TIME_SERIES, ZOO, _build,  # noqa: E402 - same folder (on sys.path)
                      _inputs)

RTOL = 1e-5
#: Model types built for generation (decoder-only and encoder-decoder).
GENERATORS = [t for t, (_, generator) in ZOO.items() if generator]
#: Model types whose forward takes ``use_cache`` and then fills a cache: run both ways.
CACHED = set(GENERATORS) | TIME_SERIES | DECODER_STATES
#: Model types with DeepSeek's latent attention: correct, or refused by name.
LATENT = {t for spec in hf_registry.REGISTRY.values() if spec.layout == "latent" for t in spec.model_types}
#: Per layout, the attention module's output projection (its output: the attention's, before any residual).
OUTPUT_PROJ = {"q_proj": "o_proj", "phi3": "o_proj", "latent": "o_proj", "bert": "output.dense", "gpt2": "c_proj",
               "qkv-grouped": "dense", "out_proj": "out_proj", "distilbert": "out_lin", "dense": "dense",
               "wqkv": "Wo"}
#: Registered classes the matrix does not patch alone, and why: converted by ``from_hf`` but never
#: patched alone (``spec.call is None``), they are covered as the ``.self`` of their parent class.
COVERED_BY_PARENT = {
    f"transformers.models.{m}.{p}SelfAttention": f"the .self of {p}Attention (patched with it)"
    for m, p in (("bert.modeling_bert", "Bert"), ("roberta.modeling_roberta", "Roberta"),
                 ("xlm_roberta.modeling_xlm_roberta", "XLMRoberta"), ("electra.modeling_electra", "Electra"),
                 # BERT's copies (hf_copies.COPIES)
                 ("camembert.modeling_camembert", "Camembert"), ("data2vec.modeling_data2vec_text", "Data2VecText"),
                 ("ernie.modeling_ernie", "Ernie"), ("roc_bert.modeling_roc_bert", "RoCBert"),
                 ("bert_generation.modeling_bert_generation", "BertGeneration"),
                 # LayoutLM's encoder-only form and its copies
                 ("layoutlm.modeling_layoutlm", "LayoutLM"), ("splinter.modeling_splinter", "Splinter"),
                 ("align.modeling_align", "AlignText"), ("chinese_clip.modeling_chinese_clip", "ChineseCLIPText"),
                 ("altclip.modeling_altclip", "AltRoberta"))}
#: The model outputs' attention fields, in this order.
FIELDS = ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions")
#: Generation: prompt tokens (decoder tokens for encoder-decoders), new tokens.
P, NEW = 4, 3


@dataclass
class Case:
    """One model type's tiny model, eager and patched, with its padded batch."""

    model: nn.Module  # eager, the oracle: never patched
    patched: nn.Module  # a patched deep copy
    batch: dict[str, torch.Tensor]
    names: list[str]  # the attention layers (registered classes patched alone), named as in ``model``


@dataclass
class Oracle:
    """The eager model's run with ``output_attentions=True``."""

    out: Any
    weights: dict[str, torch.Tensor]  # layer name -> (B, H, S, Sk), what the module returned
    outputs: dict[str, torch.Tensor]  # layer name -> (B, S, E), its output projection's output


@functools.cache
def case(model_type: str) -> Case:
    model, _ = _build(model_type)
    patched = mh.hf.patch(copy.deepcopy(model))
    # Decoder-only models left-padded (as for generation: fully masked query rows), the others right-padded.
    side = "left" if model_type in GENERATORS and model_type not in SEQ2SEQ else "right"
    names = [n for n, m in model.named_modules()
             if (spec := hf_registry.spec_of(m)) is not None and spec.call is not None]
    return Case(model, patched, _inputs(model_type, side), names)


def _cache_kw(use_cache: bool | None) -> dict[str, bool]:
    return {} if use_cache is None else {"use_cache": use_cache}


@functools.cache
def eager(model_type: str, use_cache: bool | None) -> Oracle:
    c = case(model_type)
    weights: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}
    hooks = []
    for name in c.names:
        module = c.model.get_submodule(name)
        spec = hf_registry.require_spec(module)
        proj = module.get_submodule(OUTPUT_PROJ[spec.layout])
        # BERT's encoder-only form (LayoutLM's) returns its output alone: its .self returns the weights
        source = module.get_submodule("self") if spec.call == "bert-encoder" else module
        hooks.append(source.register_forward_hook(lambda m, a, out, n=name: weights.__setitem__(n, out[1])))
        hooks.append(proj.register_forward_hook(lambda m, a, out, n=name: outputs.__setitem__(n, out)))
    try:
        with torch.no_grad():
            out = c.model(**c.batch, **_cache_kw(use_cache), output_attentions=True)
    finally:
        for hook in hooks:
            hook.remove()
    assert set(weights) == set(outputs) == set(c.names), "the oracle did not see every attention layer"
    return Oracle(out, weights, outputs)


@functools.cache
def patched_out(model_type: str, use_cache: bool | None) -> Any:
    c = case(model_type)
    with torch.no_grad():
        return c.patched(**c.batch, **_cache_kw(use_cache), output_attentions=True)


@functools.cache
def captured(model_type: str, use_cache: bool | None) -> mh.heads.Capture:
    c = case(model_type)
    with torch.no_grad(), mh.heads.capture(c.patched) as cap:
        c.patched(**c.batch, **_cache_kw(use_cache))
    return cap


REFUSED = object()


#: Types whose cache keeps one chunk of keys (Llama 4's chunked layers: chunks of 4 in the zoo), so a
#: capture around ``generate`` past the first chunk is refused: the rows cannot be aligned by key.
CHUNKED = {"llama4_text"}


def _or_refused(model_type: str, run: Callable[[], Any]) -> Any:
    """``run()``; for latent attention, a ValueError naming it is an answer too (``REFUSED``), and
    for a chunked cache (:data:`CHUNKED`) one saying the cache no longer holds every token."""
    reason = {**dict.fromkeys(LATENT, r"DeepseekV[23]Attention|latent"),
              **dict.fromkeys(CHUNKED, r"no longer holds every earlier token")}.get(model_type)
    if reason is None:
        return run()
    try:
        return run()
    except ValueError as e:
        if not re.search(reason, str(e), re.IGNORECASE):
            raise  # refused, but not for the type's reason
        return REFUSED


def _query_rows(model_type: str, batch: dict[str, torch.Tensor], decoder: bool) -> torch.Tensor | None:
    """(B, S) bool, the real queries whose rows are compared, or None (all rows)."""
    if model_type in TIME_SERIES:
        return None  # no attention mask
    if model_type in SEQ2SEQ:
        if decoder:  # the decoder's self- and cross-attention: rows of decoder tokens
            return batch["decoder_attention_mask"].bool()
        # speech encoders: frames subsampled (Speech2Text) or unpadded (Whisper); bidirectional, no row fully masked
        return batch["attention_mask"].bool() if "input_ids" in batch else None
    if "input_values" in batch:  # speech encoders: frames subsampled from samples; bidirectional
        return None
    mask = batch.get("attention_mask")
    if "returns_to_go" in batch:  # DecisionTransformer: (return, state, action) tokens per step
        return batch["attention_mask"].bool().repeat_interleave(3, dim=1)
    return None if mask is None else mask.bool()


def _in_decoder(model_type: str, name: str) -> bool:
    return model_type in SEQ2SEQ | TIME_SERIES and ".decoder." in f".{name}."


def _assert_close(got: Any, want: torch.Tensor, rows: torch.Tensor | None, dim: int, where: str) -> None:
    """``got`` has ``want``'s shape and equals it (relative to its max abs) on ``rows`` of dim ``dim``."""
    assert isinstance(got, torch.Tensor), f"{where}: got {type(got).__name__}, not a tensor"
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if rows is not None:
        got, want = got.movedim(dim, 1)[rows], want.movedim(dim, 1)[rows]  # (N, ...) real queries
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel <= RTOL, f"{where}: relative difference {rel:.2e}"


MODES = [pytest.param(t, use_cache, id=t if use_cache is None else f"{t}-{'cache' if use_cache else 'no_cache'}")
         for t in ZOO for use_cache in ((True, False) if t in CACHED else (None,))]


@pytest.mark.parametrize("model_type, use_cache", MODES)
def test_output_attentions_equal_eager(model_type: str, use_cache: bool | None) -> None:
    c, want = case(model_type), eager(model_type, use_cache).out
    got = _or_refused(model_type, lambda: patched_out(model_type, use_cache))
    if got is REFUSED:
        return
    compared = 0
    for field in FIELDS:
        wants = getattr(want, field, None)
        if wants is None:
            continue
        gots = getattr(got, field, None) or ()
        assert len(gots) == len(wants), f"{field}: {len(gots)} tensors, eager {len(wants)}"
        rows = _query_rows(model_type, c.batch, decoder=field in ("decoder_attentions", "cross_attentions"))
        for i, (g, w) in enumerate(zip(gots, wants)):
            _assert_close(g, w, rows, 2, f"{field}[{i}]")
        compared += len(wants)
    assert compared == len(c.names)  # the eager model gave one tensor per attention layer


@pytest.mark.parametrize("model_type, use_cache", MODES)
def test_capture_records_every_attention_layer_by_its_hf_name(model_type: str, use_cache: bool | None) -> None:
    cap = _or_refused(model_type, lambda: captured(model_type, use_cache))
    if cap is REFUSED:
        return
    assert cap.layers == case(model_type).names
    assert sorted(cap.weights) == sorted(cap.heads) == sorted(cap.layers), "layers run but not recorded"


@pytest.mark.parametrize("model_type, use_cache", MODES)
def test_captured_weights_equal_eager(model_type: str, use_cache: bool | None) -> None:
    c, oracle = case(model_type), eager(model_type, use_cache)
    cap = _or_refused(model_type, lambda: captured(model_type, use_cache))
    if cap is REFUSED:
        return
    for name in c.names:
        rows = _query_rows(model_type, c.batch, _in_decoder(model_type, name))
        _assert_close(cap.weights.get(name), oracle.weights[name], rows, 2, name)
    if use_cache:  # and equal to the capture without a cache, every row (padded queries: zeros in both)
        plain = captured(model_type, False)
        for name in c.names:
            _assert_close(cap.weights[name], plain.weights[name], None, 2, f"{name} (cache vs none)")


@pytest.mark.parametrize("model_type, use_cache", MODES)
def test_captured_heads_through_output_equal_the_attention_output(model_type: str, use_cache: bool | None) -> None:
    c, oracle = case(model_type), eager(model_type, use_cache)
    cap = _or_refused(model_type, lambda: captured(model_type, use_cache))
    if cap is REFUSED:
        return
    for name in c.names:
        assert name in cap.heads, f"{name}: no heads recorded"
        with torch.no_grad():
            y = cap.modules[name].output(cap.heads[name])  # (B, S, E): merge the heads, o_proj
        rows = _query_rows(model_type, c.batch, _in_decoder(model_type, name))
        _assert_close(y, oracle.outputs[name], rows, 1, name)


def _encoder_inputs(model_type: str, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An encoder-decoder's encoder inputs, unpadded."""
    key = "input_ids" if "input_ids" in batch else "input_features"
    return {key: batch[key]}


def _generate(model: nn.Module, model_type: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, P + NEW): greedy generation from the first P tokens of ``batch`` (no padding)."""
    greedy = {"max_new_tokens": NEW, "min_new_tokens": NEW, "do_sample": False, "num_beams": 1, "pad_token_id": 0}
    if model_type not in SEQ2SEQ:
        return model.generate(batch["input_ids"][:, :P], **greedy)
    start = torch.full((batch["decoder_input_ids"].shape[0], 1), model.config.decoder_start_token_id)
    prefix = torch.cat((start, batch["decoder_input_ids"][:, :P - 1]), dim=1)  # (B, P)
    if model_type == "whisper":  # the plain generation loop (as test_zoo._generate: Whisper's own wants more)
        from transformers import GenerationMixin
        return GenerationMixin.generate(model, **_encoder_inputs(model_type, batch), decoder_input_ids=prefix,
                                        **greedy)
    return model.generate(**_encoder_inputs(model_type, batch), decoder_input_ids=prefix, **greedy)


def _decoder_inputs(model_type: str, batch: dict[str, torch.Tensor], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The no-cache forward's inputs for the generated ``tokens`` (B, n) (and the same encoder inputs)."""
    if model_type not in SEQ2SEQ:
        return {"input_ids": tokens}
    return {**_encoder_inputs(model_type, batch), "decoder_input_ids": tokens}


def _appended(refs: dict[int, mh.heads.Capture], calls: list[tuple[int, int]], name: str,
              kind: str) -> torch.Tensor:
    """What a capture around the ``calls`` (first position, tokens) holds for ``name``: each call's rows
    of ``kind`` (weights, heads) in order, from the no-cache forward of the tokens it had seen,
    weights zero-padded on the right to the longest key count."""
    parts = [getattr(refs[p + n], kind)[name][:, :, p:p + n] for p, n in calls]  # (B, H, n, Sk or D) each
    width = max(t.shape[-1] for t in parts)
    return torch.cat([F.pad(t, (0, width - t.shape[-1])) for t in parts], dim=2)


@pytest.mark.parametrize("model_type", GENERATORS)
def test_capture_during_generate_appends_every_call(model_type: str) -> None:
    c, what = case(model_type), ("weights", "heads", "k", "v")
    calls: list[tuple[int, int]] = []  # (first position, tokens) of each call of the model

    def note(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache, tokens = kwargs.get("cache"), kwargs.get("decoder_input_ids", kwargs.get("input_ids"))
        calls.append((0 if cache is None else cache.get_seq_length(), tokens.shape[1]))

    def run() -> tuple[mh.heads.Capture, torch.Tensor]:
        hook = c.patched.register_forward_pre_hook(note, with_kwargs=True)
        try:
            with torch.no_grad(), mh.heads.capture(c.patched, what=what) as cap:
                tokens = _generate(c.patched, model_type, c.batch)
        finally:
            hook.remove()
        return cap, tokens

    got = _or_refused(model_type, run)
    if got is REFUSED:
        return
    cap, tokens = got
    assert tokens.shape[1] == P + NEW
    # One call per step: the prefill of P tokens, then one token at a time; Phi-3's longrope drops
    # the cache when the sequence first outgrows original_max_position_embeddings (4) and runs the
    # whole sequence again (its second call is (0, P + 1)): those rows are appended too.
    assert len(calls) == NEW and calls[0] == (0, P) and calls[-1] == (P + 1, 1), calls
    refs: dict[int, mh.heads.Capture] = {}
    for end in sorted({p + n for p, n in calls}):
        with torch.no_grad(), mh.heads.capture(c.patched, what=what) as refs[end]:
            c.patched(**_decoder_inputs(model_type, c.batch, tokens[:, :end]), use_cache=False)
    last = refs[P + 2]  # the no-cache forward of the first P + 2 tokens
    for name in c.names:
        once = model_type in SEQ2SEQ and not _in_decoder(model_type, name)  # the encoder runs once
        for kind in what:
            if once or kind in ("k", "v"):  # k, v: the last call's, every key it held
                want = getattr(last, kind)[name]
            else:
                want = _appended(refs, calls, name, kind)
            _assert_close(getattr(cap, kind).get(name), want, None, 2, f"{name} {kind}")


@pytest.mark.parametrize("model_type", list(ZOO))
def test_a_second_plain_call_inside_one_capture_is_refused(model_type: str) -> None:
    c, kw = case(model_type), _cache_kw(False if model_type in CACHED else None)

    def run() -> None:
        with torch.no_grad(), mh.heads.capture(c.patched):
            c.patched(**c.batch, **kw)
            with pytest.raises(ValueError, match="called twice inside one capture"):
                c.patched(**c.batch, **kw)

    _or_refused(model_type, run)


def test_the_matrix_covers_the_registry() -> None:
    """Every registered class is in a matrix model: patched alone, or inside its patched parent."""
    alone, inside = set(), set()
    for model_type in ZOO:
        c = case(model_type)
        for name, module in c.model.named_modules():
            spec = hf_registry.spec_of(module)
            if spec is not None and spec.call is None:
                assert name.rpartition(".")[0] in c.names, f"{model_type}: {spec.name} at {name} outside a parent"
                inside.add(spec.cls)
            elif spec is not None:
                alone.add(spec.cls)
    assert set(COVERED_BY_PARENT) == {k for k, s in hf_registry.REGISTRY.items() if s.call is None}
    assert inside == set(COVERED_BY_PARENT)
    assert alone == set(hf_registry.REGISTRY) - set(COVERED_BY_PARENT)
