"""``mh.hf.KVCacheAdapter``: transformers' ``generate`` on multihead's in-place KVCache (issue #13).

Notation: B batch, S tokens, Hkv key/value heads, D head_dim.

Oracle: the unpatched transformers model generating with its default cache (DynamicCache).
Small models (E=64, H=4, Hkv=2: GQA with RoPE) with random weights ×4 (far from uniform
attention); greedy tokens must be identical.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import multihead as mh
from multihead import decode
from multihead.backends import native

transformers = pytest.importorskip("transformers")
from transformers import CONFIG_MAPPING, AutoModelForCausalLM  # noqa: E402
from test_zoo import sharpen  # noqa: E402 - same folder (pytest puts it on sys.path)

VOCAB, S, NEW = 100, 9, 6
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=128,
            vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
GREEDY = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
NOT_FUSED_REASONS = {reason for reason, _ in decode.FUSED_CONDITIONS}


def _model(model_type: str = "llama", impl: str = "sdpa", **extra: Any) -> nn.Module:
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**{**TINY, **extra}),
                                                 attn_implementation=impl).eval()
    sharpen(model)
    return model


def _prompts(padded: bool) -> dict[str, torch.Tensor]:
    """Two prompts; with ``padded`` the second has 3 padding tokens on the left (as HF pads for generation)."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, S, dtype=torch.long)
    if padded:
        mask[1, :3] = 0
    return {"input_ids": torch.randint(3, VOCAB, (2, S), generator=g), "attention_mask": mask}


def _same_tokens_as_hf(model: nn.Module, prompts: dict[str, torch.Tensor], **kw: Any) -> Any:
    """Generate unpatched (HF's default cache), patch, generate with the adapter: same tokens; the adapter."""
    with torch.no_grad():
        want = model.generate(**prompts, **GREEDY, **kw)
    if not mh.hf.is_patched(model):
        mh.hf.patch(model)
    cache = mh.hf.KVCacheAdapter(model, max_len=S + NEW)
    with torch.no_grad():
        got = model.generate(**prompts, **GREEDY, cache=cache, **kw)
    assert torch.equal(got, want)
    return cache


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_llama_gqa_left_padded_batch_generates_hf_tokens(impl: str) -> None:
    """The padding slots are held (and written in place) as HF's caches hold them; decoding takes
    the fused step from each row's first real slot where the kernel runs here, else update."""
    cache = _same_tokens_as_hf(_model(impl=impl), _prompts(padded=True))
    if native.vector_bits() >= 256:
        assert cache.paths == ["fused", "fused"]
    else:
        assert all(path.startswith("update") for path in cache.paths)
    assert cache.get_seq_length() == S + NEW - 1  # the last token is never fed back


def test_unpadded_batch_takes_the_fused_step_or_says_why_not() -> None:
    """No mask (sdpa, no padding): the fused native step where it applies, else update with its reason."""
    cache = _same_tokens_as_hf(_model(), _prompts(padded=False))
    for path, layer in zip(cache.paths, cache.slots):
        assert path == "fused" or path.removeprefix("update (not fused: ").removesuffix(")") in NOT_FUSED_REASONS, path
        assert layer.kv.host_lengths() == [S + NEW - 1] * 2


@pytest.mark.skipif(native.vector_bits() < 256, reason=f"no AVX-512 or AVX2 native kernel here ({native.status()})")
@pytest.mark.parametrize("model_type, impl, extra", [("mistral", "sdpa", {"sliding_window": 4}),
                                                     ("llama", "eager", {})])
def test_a_mask_that_is_the_layers_own_rule_takes_the_fused_step(model_type: str, impl: str, extra: dict) -> None:
    """Decoding, HF passes a mask that says nothing beyond the layer's own rule: a sliding layer's
    once the cache passes its window (4 keys; the prompt alone holds 9), an eager model's all-True
    one. The fused step applies that rule itself: it runs, with HF's tokens; with left padding in
    the batch too (the rule over each row's keys from its first real one)."""
    for padded in (False, True):
        cache = _same_tokens_as_hf(_model(model_type, impl, **extra), _prompts(padded=padded))
        assert cache.paths == ["fused", "fused"] and cache.get_seq_length() == S + NEW - 1


def _ragged_prompts(pads: list[int]) -> dict[str, torch.Tensor]:
    """One prompt per row of S tokens, row b left-padded with ``pads[b]`` pad tokens (as HF pads)."""
    g = torch.Generator().manual_seed(2)
    mask = (torch.arange(S)[None, :] >= torch.tensor(pads)[:, None]).long()  # (B, S)
    return {"input_ids": torch.randint(3, VOCAB, (len(pads), S), generator=g) * mask, "attention_mask": mask}


@pytest.mark.skipif(native.vector_bits() < 256, reason=f"no AVX-512 or AVX2 native kernel here ({native.status()})")
@pytest.mark.parametrize("model_type, extra", [("llama", {}), ("qwen3", {}), ("mistral", {"sliding_window": 5})])
def test_a_left_padded_batch_of_8_takes_the_fused_step_with_hf_tokens(model_type: str, extra: dict) -> None:
    """Eight rows padded by 0 to 7 tokens: each row's keys from its first real slot, its RoPE
    positions counted from there, in the one-call step of every layer (Qwen3: its q/k norm too;
    Mistral: a window of 5 keys); HF's greedy tokens."""
    cache = _same_tokens_as_hf(_model(model_type, **extra), _ragged_prompts([0, 3, 7, 1, 5, 2, 6, 4]))
    assert cache.paths == ["fused", "fused"]


@pytest.mark.skipif(native.vector_bits() < 256, reason=f"no AVX-512 or AVX2 native kernel here ({native.status()})")
def test_the_fused_step_of_a_padded_batch_reads_each_rows_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the rows' first slots dropped on the way to the kernel (padding attended, positions
    counted from slot 0): HF's tokens are not reproduced, so the starts are what makes it exact."""
    call = decode.FusedStep.__call__
    monkeypatch.setattr(decode.FusedStep, "__call__", lambda self, x, **kw: call(self, x, **{**kw, "starts": None}))
    with pytest.raises(AssertionError):
        _same_tokens_as_hf(_model(), _ragged_prompts([0, 3, 7, 1, 5, 2, 6, 4]))


def test_the_layers_own_cached_call_generates_hf_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The branch a layer with hooks takes (``layer(x, cache=kv)``), forced here for every call:
    where the fused step cannot run, the module's own cached call runs it, in place, and must agree."""
    from multihead.interop import hf_cache

    monkeypatch.setattr(hf_cache, "fused_for", lambda layer, x, kv: object())  # "fused": not a reason
    monkeypatch.setattr(hf_cache, "_bare", lambda layer: False)
    cache = _same_tokens_as_hf(_model(), _prompts(padded=False))
    assert cache.paths == ["fused", "fused"] and cache.get_seq_length() == S + NEW - 1


def test_a_hook_on_the_layer_runs_at_every_fused_step() -> None:
    """The adapter runs the fused step without the module call only when that call adds nothing:
    with a forward hook on the layer, the hook still sees every decoding step, tokens unchanged."""
    model, prompts = _model(), _prompts(padded=False)
    with torch.no_grad():
        want = model.generate(**prompts, **GREEDY)
    mh.hf.patch(model)
    seen: list[int] = []
    model.model.layers[0].self_attn.mh.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    cache = mh.hf.KVCacheAdapter(model, max_len=S + NEW)
    with torch.no_grad():
        assert torch.equal(model.generate(**prompts, **GREEDY, cache=cache), want)
    assert seen == ([1] * (NEW - 1) if cache.paths[0] == "fused" else [])  # prefill goes through update


@pytest.mark.parametrize("padded", [True, False])
def test_qwen3_gqa_rope_qk_norm_generates_hf_tokens(padded: bool) -> None:
    _same_tokens_as_hf(_model("qwen3", head_dim=16), _prompts(padded))


@pytest.mark.parametrize("num_beams", [2, 3])
@pytest.mark.parametrize("padded", [True, False])
def test_beam_search_reorders_the_buffers_in_place(num_beams: int, padded: bool) -> None:
    """HF's beam search reorders the cache's rows at every step (``reorder_cache``): the same
    beams as with its own cache, on the fused step (no padding) and through update (padding)."""
    _same_tokens_as_hf(_model(), _prompts(padded), num_beams=num_beams)


def test_unpatched_model_writes_in_place_through_update() -> None:
    model = _model()
    with torch.no_grad():
        want = model.generate(**_prompts(padded=True), **GREEDY)
        cache = mh.hf.KVCacheAdapter(model, max_len=S + NEW)
        assert torch.equal(model.generate(**_prompts(padded=True), **GREEDY, cache=cache), want)
    assert cache.paths == ["update", "update"]


def test_decoding_writes_the_preallocated_buffers_in_place() -> None:
    model = mh.hf.patch(_model())
    prompts = _prompts(padded=True)
    cache = mh.hf.KVCacheAdapter(model, max_len=16)
    with torch.no_grad():
        out = model(**prompts, cache=cache, use_cache=True)
        buffers = [(slot.kv.k.data_ptr(), slot.kv.v.data_ptr()) for slot in cache.slots]
        mask = prompts["attention_mask"]
        for _ in range(3):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            out = model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask, cache=cache, use_cache=True)
    assert [(slot.kv.k.data_ptr(), slot.kv.v.data_ptr()) for slot in cache.slots] == buffers
    assert cache.slots[0].kv.k.shape == (2, 2, 16, 16)  # (B, Hkv, max_len, D), allocated once
    assert cache.get_seq_length() == S + 3 and cache.nbytes == 2 * 2 * (2 * 2 * 16 * 16 * 4)


def test_more_new_tokens_than_preallocated_are_refused_before_writing() -> None:
    model = mh.hf.patch(_model())
    cache = mh.hf.KVCacheAdapter(model, max_len=S + 2)
    with pytest.raises(ValueError, match=r"holds 11 of max_len=11 tokens per row: 1 more do not fit; "
                                         r"make max_len >= prompt length \+ max_new_tokens"):
        with torch.no_grad():
            model.generate(**_prompts(padded=False), **GREEDY, cache=cache)
    assert cache.get_seq_length() == S + 2 and [s.kv.host_lengths() for s in cache.slots] == [[11, 11]] * 2


def test_crop_removes_the_last_tokens() -> None:
    model = mh.hf.patch(_model())
    cache = mh.hf.KVCacheAdapter(model, max_len=16)
    with torch.no_grad():
        model(**_prompts(padded=False), cache=cache, use_cache=True)
    cache.crop(-4)
    assert cache.get_seq_length() == S - 4 and cache.slots[1].keys.shape[2] == S - 4
    with pytest.raises(ValueError, match="negative count"):
        cache.crop(3)


def test_batch_changes_on_a_filled_cache_are_refused() -> None:
    model = mh.hf.patch(_model())
    cache = mh.hf.KVCacheAdapter(model, max_len=16)
    cache.batch_repeat_interleave(2)  # empty: nothing to change
    with torch.no_grad():
        model(**_prompts(padded=False), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="cannot batch_repeat_interleave: its buffers are preallocated"):
        cache.batch_repeat_interleave(2)


def test_latent_attention_is_refused_by_name() -> None:
    model = mh.hf.patch(_model("deepseek_v3", kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=12,
                               qk_rope_head_dim=8, v_head_dim=10, num_key_value_heads=4, first_k_dense_replace=2))
    cache = mh.hf.KVCacheAdapter(model, max_len=16)
    with pytest.raises(ValueError, match="DeepSeek's latent attention caches the latent and the rotary key"):
        with torch.no_grad():
            model(**_prompts(padded=False), cache=cache, use_cache=True)


def test_training_through_the_adapter_is_refused() -> None:
    model = _model()
    cache = mh.hf.KVCacheAdapter(model, max_len=16)
    with pytest.raises(ValueError, match="KVCacheAdapter is for inference"):
        model(**_prompts(padded=False), cache=cache, use_cache=True)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        mh.hf.KVCacheAdapter(_model(), max_len=0)
    with pytest.raises(TypeError, match="model must be a transformers model or config"):
        mh.hf.KVCacheAdapter(object(), max_len=8)


def test_the_adapter_is_a_transformers_cache() -> None:
    from transformers import Cache

    cache = mh.hf.KVCacheAdapter(_model().config, max_len=8)
    assert isinstance(cache, Cache) and isinstance(cache, mh.hf.KVCacheAdapter)
    assert cache.get_max_length() == 8 and cache.get_seq_length() == 0 and not cache.is_compileable


# ---- one adapter, several generate calls (a new generate starts empty) ----------------------
def _prompt_sets() -> list[dict[str, torch.Tensor]]:
    """A prompt of batch 1, a left-padded batch of 3 (rows padded by 0, 2 and 4 tokens), and a
    left-padded batch of 8 (row b padded by b tokens)."""
    g = torch.Generator().manual_seed(2)
    one = {"input_ids": torch.randint(3, VOCAB, (1, S), generator=g),
           "attention_mask": torch.ones(1, S, dtype=torch.long)}
    mask = torch.ones(3, S, dtype=torch.long)
    mask[1, :2], mask[2, :4] = 0, 0
    three = {"input_ids": torch.randint(3, VOCAB, (3, S), generator=g), "attention_mask": mask}
    return [one, three, left_padded(8, S, g)]


def left_padded(batch: int, length: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """``batch`` prompts of ``length`` tokens, row b with b padding tokens on the left (as HF pads)."""
    mask = (torch.arange(length)[None, :] >= torch.arange(batch)[:, None]).long()  # (B, S)
    return {"input_ids": torch.randint(3, VOCAB, (batch, length), generator=g), "attention_mask": mask}


@pytest.mark.parametrize("patched", [True, False])
def test_one_adapter_reused_for_every_generate_gives_hf_tokens_each_time(patched: bool) -> None:
    """Twice in a row per prompt set, from batch 1 to batch 3 to batch 8, on one adapter: every
    call starts empty (as transformers' generate hands it the cache), so each equals unpatched HF."""
    model, sets = _model(), _prompt_sets()
    with torch.no_grad():
        wants = [model.generate(**prompts, **GREEDY) for prompts in sets]
    if patched:
        mh.hf.patch(model)
    cache = mh.hf.KVCacheAdapter(model, max_len=S + NEW)
    for prompts, want in zip(sets, wants):
        for _ in range(2):
            with torch.no_grad():
                got = model.generate(**prompts, **GREEDY, cache=cache)
            assert torch.equal(got, want)
            assert cache.get_seq_length() == S + NEW - 1


def test_a_generate_continuing_forgotten_tokens_is_refused_by_name() -> None:
    """The adapter forgets what it held when a generate begins: a call that passes only new tokens
    (with the whole mask, to continue the held ones) is refused before anything is written."""
    model, prompts = mh.hf.patch(_model()), _prompts(padded=False)
    cache = mh.hf.KVCacheAdapter(model, max_len=2 * (S + NEW))
    with torch.no_grad():
        first = model.generate(**prompts, **GREEDY, cache=cache)
        mask = torch.ones(2, first.shape[1] + 2, dtype=torch.long)
        with pytest.raises(ValueError, match=r"starts every generate empty .* held 14 tokens per row.*"
                                             r"pass generate the whole sequence"):
            model.generate(input_ids=torch.full((2, 2), 5), attention_mask=mask, **GREEDY, cache=cache)
    assert cache.get_seq_length() == 0 and all(s.kv.host_lengths() == [0, 0] for s in cache.slots)


def test_a_generate_continuing_tokens_a_new_adapter_never_held_is_refused_by_name() -> None:
    """The same rule on a new adapter: a generate's first tokens are at position 0."""
    model = mh.hf.patch(_model())
    cache = mh.hf.KVCacheAdapter(model, max_len=32)
    with pytest.raises(ValueError, match=r"starts every generate empty \(it held 0 tokens per row.*first tokens are "
                                         r"at position 10: pass generate the whole sequence"):
        with torch.no_grad():
            model.generate(input_ids=torch.full((2, 2), 5), attention_mask=torch.ones(2, 12, dtype=torch.long),
                           **GREEDY, cache=cache)
    assert cache.get_seq_length() == 0 and [s.kv for s in cache.slots] == [None, None]


# ---- an adapter built for another model --------------------------------------------------------
@pytest.mark.parametrize("patched", [True, False])
def test_an_adapter_for_fewer_layers_is_refused_and_no_layer_changes(patched: bool) -> None:
    """Built for 2 layers, used with 3: a ValueError naming both counts; layers 0-1 hold what they held."""
    short, deep = _model(), _model(num_hidden_layers=3)
    if patched:
        mh.hf.patch(deep)
    cache = mh.hf.KVCacheAdapter(short, max_len=16)
    with pytest.raises(ValueError, match=r"KVCacheAdapter was built for 2 layers, got a call for layer 2 "
                                         r"\(the model has at least 3\)"):
        with torch.no_grad():
            deep(**_prompts(padded=False), cache=cache, use_cache=True)
    assert cache.get_seq_length() == 0 and [s.kv for s in cache.slots] == [None, None]
    with torch.no_grad():  # a filled cache: the refused step leaves the held tokens as they were
        short(**_prompts(padded=False), cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="built for 2 layers"):
            deep(input_ids=torch.full((2, 1), 5), cache=cache, use_cache=True)
    assert [s.kv.host_lengths() for s in cache.slots] == [[S, S]] * 2 and cache.slots[1].keys.shape[2] == S


@pytest.mark.skipif(native.vector_bits() < 256, reason=f"no AVX-512 or AVX2 native kernel here ({native.status()})")
@pytest.mark.parametrize("model_type, extra", [
    ("qwen3", {}),
    ("hunyuan_v1_dense", {"head_dim": 16, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                              "alpha": 50.0, "factor": 1.0}}),
    ("llama4_text", {"head_dim": 16, "num_local_experts": 2, "intermediate_size_mlp": 32, "no_rope_layers": [1, 1],
                     "use_qk_norm": True}),
    ("olmo2", {}), ("olmo3", {"sliding_window": 40})])
def test_families_with_a_qk_norm_per_head_take_the_fused_step_with_hf_tokens(model_type: str, extra: dict) -> None:
    """Qwen3's q/k RMSNorm before RoPE, HunYuan's after it, Llama 4's weightless L2 norm (our weight
    ones, a buffer) and OLMo 2's and 3's norm across the whole projection run inside the one-call step
    (OLMo 3's sliding layers too: transformers passes them no mask while the cache is shorter than the
    window, and past it a mask that is their own rule)."""
    cache = _same_tokens_as_hf(_model(model_type, **extra), _prompts(padded=False))
    assert cache.paths == ["fused", "fused"]
