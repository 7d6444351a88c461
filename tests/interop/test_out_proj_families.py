"""CLIP, SigLIP, OPT, BART, mBART, Whisper and DistilBERT: converted and patched exactly (issue #15 item 8);
BART's copies (PEGASUS, Marian, PLBart, M2M100/NLLB, Blenderbot, Blenderbot-Small, BioGPT, NLLB-MoE and
Speech2Text; the last two run eager only in transformers, so they are compared with eager here too).

The zoo (tests/interop/test_zoo.py) compares each with ``attn_implementation="eager"``; here
the default ``"sdpa"``, where HF drops masks that causality alone describes (CLIP's text
tower is then causal only through the ``is_causal=True`` its encoder passes), every step of
greedy generation (logits, not only tokens), the encoder-decoder cache a patched model fills
(self- and cross-attention), ``from_hf`` of single modules against their HF forward, and
the checkpoint layout. Models: tiny configs (E=64, H=4, 2 layers), random weights ×4,
float32. Runtime: about 2 minutes on 2 shared cores (generation loops, most of it).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import multihead as mh

from test_zoo import VOCAB, ZOO, build, sharpen, tiny_config  # same folder (pytest puts it on sys.path)

B, S, RTOL = 2, 9, 1e-5
SEQ2SEQ = ("bart", "mbart", "whisper")
#: Encoder-decoders whose class is BartAttention's (hf_registry._BART_COPIES; BioGPT, decoder-only, too).
BART_COPIES = ("pegasus", "marian", "plbart", "m2m_100", "blenderbot", "blenderbot-small", "nllb-moe", "speech_to_text")
#: Models transformers runs with eager attention only (no sdpa): compared with eager here.
EAGER_ONLY = ("nllb-moe", "speech_to_text")
CAUSAL_LM = ("opt", "biogpt")


def _model(model_type: str, impl: str = "sdpa") -> nn.Module:
    from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM,
                              AutoModelForSpeechSeq2Seq)

    auto = {"opt": AutoModelForCausalLM, "biogpt": AutoModelForCausalLM, "whisper": AutoModelForSpeechSeq2Seq,
            "speech_to_text": AutoModelForSpeechSeq2Seq}.get(
        model_type, AutoModelForSeq2SeqLM if model_type in SEQ2SEQ + BART_COPIES else AutoModel)
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        impl = "eager" if model_type in EAGER_ONLY else impl
        model = build(model_type, tiny_config(model_type, **ZOO[model_type][0]), auto, impl).eval()
    sharpen(model)
    return model


def _mask(length: int, side: str | None) -> torch.Tensor:
    mask = torch.ones(B, length, dtype=torch.long)
    if side == "right":
        mask[1, length - 3:] = 0
    elif side == "left":
        mask[1, :3] = 0
    return mask


def _inputs(model_type: str, side: str | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if model_type.endswith("vision_model"):
        return {"pixel_values": torch.randn(B, 3, 32, 32, generator=g)}
    if model_type == "whisper":
        inputs = {"input_features": torch.randn(B, 8, 32, generator=g)}
    elif model_type == "speech_to_text":  # 36 frames, 12 of them padding: 6 of 9 after subsampling
        mask = torch.ones(B, 4 * S, dtype=torch.long)
        mask[1, -12:] = 0
        inputs = {"input_features": torch.randn(B, 4 * S, 8, generator=g), "attention_mask": mask}
    else:
        inputs = {"input_ids": torch.randint(3, VOCAB, (B, S), generator=g), "attention_mask": _mask(S, side)}
    if model_type in SEQ2SEQ + BART_COPIES:
        inputs.update(decoder_input_ids=torch.randint(3, VOCAB, (B, S - 2), generator=g),
                      decoder_attention_mask=_mask(S - 2, side))
    return inputs


def _rel(got: torch.Tensor, want: torch.Tensor, real: Any = ...) -> float:
    return ((got[real] - want[real]).abs().max() / want[real].abs().max()).item()


def _outputs(model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
    with torch.no_grad():
        out = model(**inputs)
    if "decoder_attention_mask" in inputs:
        tokens = "attention_mask" in inputs and "input_features" not in inputs  # (speech frames are subsampled)
        enc_real = inputs["attention_mask"].bool() if tokens else ...
        return [(out.logits, inputs["decoder_attention_mask"].bool()), (out.encoder_last_hidden_state, enc_real)]
    if getattr(out, "logits", None) is not None:
        return [(out.logits, inputs["attention_mask"].bool())]
    real = inputs["attention_mask"].bool() if "attention_mask" in inputs else ...
    return [(out.last_hidden_state, real), (out.pooler_output, ...)] if getattr(out, "pooler_output", None) \
        is not None else [(out.last_hidden_state, real)]


@pytest.mark.parametrize("model_type", ["clip_text_model", "clip_vision_model", "siglip_text_model",
                                        "siglip_vision_model", "opt", *SEQ2SEQ, "distilbert",
                                        *(t for t in BART_COPIES if t not in EAGER_ONLY), "biogpt"])
@pytest.mark.parametrize("side", ["left", None])
def test_patched_equals_unpatched_with_sdpa(model_type: str, side: str | None) -> None:
    """sdpa: with no padding (side None) HF hands attention no mask at all, only is_causal
    (right padding: the zoo, eager)."""
    model = _model(model_type)
    inputs = _inputs(model_type, side)
    wants = _outputs(model, inputs)
    mh.hf.patch(model)
    assert sum(isinstance(m, mh.hf.PatchedAttention) for m in model.modules()) >= 2
    for (got, _), (want, real) in zip(_outputs(model, inputs), wants):
        assert _rel(got, want, real) <= RTOL


def test_clip_text_without_padding_is_causal() -> None:
    """The case only the is_causal keyword decides: the last token changes no earlier state."""
    model = mh.hf.patch(_model("clip_text_model"))
    ids = _inputs("clip_text_model", None)["input_ids"]
    other = ids.clone()
    other[:, -1] = 3 + (ids[:, -1] - 2) % (VOCAB - 3)
    with torch.no_grad():
        a, b = model(input_ids=ids).last_hidden_state, model(input_ids=other).last_hidden_state
    assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1])


def _generate(model: nn.Module, model_type: str) -> Any:
    from transformers import GenerationMixin

    inputs = _inputs(model_type, "left")
    greedy = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "pad_token_id": 0,
              "output_logits": True, "return_dict_in_generate": True}
    if model_type == "whisper":  # the plain generation loop (Whisper's own wants a real generation config)
        return GenerationMixin.generate(model, input_features=inputs["input_features"],
                                        decoder_input_ids=torch.full((B, 1), 2), **greedy)
    main = inputs.get("input_ids", inputs.get("input_features"))  # Speech2Text: features
    return model.generate(main, attention_mask=inputs["attention_mask"], **greedy)


@pytest.mark.parametrize("model_type", ["opt", *SEQ2SEQ, *BART_COPIES, "biogpt"])
def test_greedy_generation_gives_the_same_logits_at_every_step(model_type: str) -> None:
    """A left-padded batch of two; the decoders of BART, mBART and Whisper read the encoder's
    keys and values from the cross-attention cache after the first step (eager: the zoo)."""
    model = _model(model_type)
    want = _generate(model, model_type)
    got = _generate(mh.hf.patch(model), model_type)
    assert torch.equal(got.sequences, want.sequences)
    assert _rel(torch.stack(got.logits), torch.stack(want.logits)) <= RTOL


@pytest.mark.parametrize("model_type", SEQ2SEQ + BART_COPIES)
def test_the_encoder_decoder_cache_is_filled_as_hf_fills_it(model_type: str) -> None:
    model = _model(model_type)
    inputs = _inputs(model_type, "right")

    def cache() -> Any:
        with torch.no_grad():
            return model(**inputs, use_cache=True).past_key_values

    want = cache()
    mh.hf.patch(model)
    got = cache()
    assert got.is_updated == want.is_updated == {0: True, 1: True}
    for part in ("self_attention_cache", "cross_attention_cache"):
        for mine, theirs in zip(getattr(got, part).layers, getattr(want, part).layers, strict=True):
            assert _rel(mine.keys, theirs.keys) <= RTOL and _rel(mine.values, theirs.values) <= RTOL


def _modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from multihead.interop import hf_registry

    return [(n, m) for n, m in model.named_modules() if hf_registry.spec_of(m) is not None]


@pytest.mark.parametrize("model_type", ["clip_text_model", "opt", *SEQ2SEQ, "distilbert", *BART_COPIES, "biogpt"])
def test_from_hf_equals_the_hf_module(model_type: str) -> None:
    """Each attention module alone: self-attention (causal where the class is), and the
    decoders' cross-attention to an encoder output with padding."""
    model = _model(model_type, "eager")
    g = torch.Generator().manual_seed(3)
    x, enc = torch.randn(B, 5, 64, generator=g), torch.randn(B, 7, 64, generator=g)
    keep = torch.ones(B, 1, 5, 7, dtype=torch.bool)
    keep[1, ..., 4:] = False  # the second row's encoder output has 3 padding tokens
    additive = torch.zeros(B, 1, 5, 7).masked_fill(~keep, torch.finfo(torch.float32).min)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    causal_additive = torch.zeros(1, 1, 5, 5).masked_fill(~causal, torch.finfo(torch.float32).min)
    for name, module in _modules(model):
        layer = mh.MultiHeadAttention.from_hf(module)
        with torch.no_grad():
            if name.endswith("encoder_attn"):
                want, _ = module(x, key_value_states=enc, attention_mask=additive)
                got = layer(x, enc, mask=keep)
            else:
                want, _ = module(x, attention_mask=causal_additive if layer.causal else None)
                got = layer(x)
        assert _rel(got, want) <= RTOL, name


def test_whisper_k_proj_has_no_bias_and_round_trips() -> None:
    model = _model("whisper", "eager")
    module = model.model.decoder.layers[0].encoder_attn
    layer = mh.MultiHeadAttention.from_hf(module)
    assert layer.k_proj.bias is None and layer.q_proj.bias is not None
    hf = mh.interop.state_to_hf(layer.state_dict(), module)
    assert set(hf) == set(dict(module.named_parameters()))
    assert all(torch.equal(hf[k], p) for k, p in module.named_parameters())


@pytest.mark.parametrize("model_type", ["clip_text_model", "opt", "bart", "whisper", "distilbert"])
def test_a_patched_model_keeps_its_checkpoint_layout(model_type: str) -> None:
    model = _model(model_type, "eager")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mh.hf.patch(model)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, mh.hf.PatchedAttention):
                m.mh.o_proj.weight.mul_(2)  # trained while patched: saved in the original names
    after = model.state_dict()
    assert list(after) == list(before)
    o_name = "out_lin" if model_type == "distilbert" else "out_proj"
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(f"{o_name}.weight" in k for k in changed)


def test_a_cross_attention_batch_that_differs_is_refused() -> None:
    model = mh.hf.patch(_model("bart", "eager"))
    attn = model.model.decoder.layers[0].encoder_attn
    with pytest.raises(ValueError, match="batch size of hidden_states"):
        attn(torch.randn(2, 3, 64), key_value_states=torch.randn(1, 6, 64))


def _siglip(impl: str) -> nn.Module:
    """SiglipModel (both towers, the vision tower's pooling head) at the zoo's tiny sizes."""
    from transformers import SiglipConfig, SiglipModel

    text, vision = (tiny_config(t).to_dict() for t in ("siglip_text_model", "siglip_vision_model"))
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SiglipModel(SiglipConfig(text_config=text, vision_config=vision)).eval()
    model.set_attn_implementation(impl)
    sharpen(model)
    return model


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_siglip_patches_exactly_and_leaves_its_pooling_head_alone(impl: str) -> None:
    """Both towers' SiglipAttention patched (strict); the pooling head's torch MHA, whose query
    is a learned probe, stays torch's: the pooled image embeddings and the logits equal."""
    model = _siglip(impl)
    head = model.vision_model.head
    inputs = {**_inputs("siglip_text_model", "right"), **_inputs("siglip_vision_model", None)}
    with torch.no_grad():
        want = model(**inputs)
    mh.hf.patch(model)
    assert sum(isinstance(m, mh.hf.PatchedAttention) for m in model.modules()) == 4
    assert model.vision_model.head is head and type(head.attention) is nn.MultiheadAttention
    with torch.no_grad():
        got = model(**inputs)
    for key in ("image_embeds", "text_embeds", "logits_per_image"):
        assert _rel(got[key], want[key]) <= RTOL, key
    assert _rel(got.vision_model_output.pooler_output, want.vision_model_output.pooler_output) <= RTOL
    assert not torch.equal(got.text_embeds[0], got.text_embeds[1])  # not vacuous: the rows differ


def test_siglip_text_tower_is_bidirectional() -> None:
    """The last token changes the earlier states (CLIP's tower would not: causal)."""
    model = mh.hf.patch(_model("siglip_text_model"))
    ids = _inputs("siglip_text_model", None)["input_ids"]
    other = ids.clone()
    other[:, -1] = 3 + (ids[:, -1] - 2) % (VOCAB - 3)
    with torch.no_grad():
        a, b = model(input_ids=ids).last_hidden_state, model(input_ids=other).last_hidden_state
    assert not torch.equal(a[:, 0], b[:, 0])


@pytest.mark.parametrize("model_type, cls, extra", [
    # their decoders' class is BART's, their encoders' is not (global-local, block-sparse)
    ("pegasus_x", "PegasusXGlobalLocalAttention", {}), ("bigbird_pegasus", "BigBirdPegasusEncoderAttention", {}),
    ("mvp", "MvpAttention", {}),  # BART's layout with learned prompt keys and values: not described
    ("informer", "InformerProbSparseAttention", {"prediction_length": 4}),  # Informer's default attention_type
])
def test_families_not_described_are_refused_by_name(model_type: str, cls: str, extra: dict[str, Any]) -> None:
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        from transformers import AutoModel
        model = AutoModel.from_config(tiny_config(model_type, **extra))
    with pytest.raises(ValueError, match=f"{cls} is not a supported attention class"):
        mh.hf.patch(model)
