"""Thread counts chosen by measurement (:mod:`multihead.threads`): the chooser on a simulated clock,
the blocks it finds, and :func:`multihead.auto_threads` on real and timed-by-the-test models."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.threads import AutoThreads, ThreadChooser, repeated_blocks

pytest.importorskip("transformers")

from multihead.tools import bench_generate  # noqa: E402


class _Clock:
    """A machine whose seconds per token on 2 threads and on 1 are set by the test."""

    def __init__(self, two: float, one: float) -> None:
        self.rate = {2: two, 1: one}

    def run(self, chooser: ThreadChooser, calls: int, spikes: dict[int, float] | None = None) -> list[int]:
        used = []
        for i in range(calls):
            used.append(chooser.next())
            slower = (spikes or {}).get(i, 1.0)  # a call that takes this many times as long
            chooser.record(used[-1], self.rate[used[-1]] * 100 * slower, 100)
        return used


def test_the_thread_chooser_keeps_the_faster_count_and_changes_when_the_load_does() -> None:
    chooser, machine = ThreadChooser(2), _Clock(two=1.0, one=1.4)  # idle: 2 threads faster
    used = machine.run(chooser, 40)
    assert used[:4] == [2, 2, 1, 2] and used.count(1) == 2  # one try at the start, one after PERIOD calls
    machine.rate = {2: 2.4, 1: 1.45}  # another process takes a core: 2 threads 2.4× slower, one thread not
    used = machine.run(chooser, 5)
    assert used == [2, 1, 1, 1, 1] and chooser.choice == 1
    machine.rate = {2: 1.0, 1: 1.4}  # the other process ends: the periodic try finds 2 threads faster again
    used = machine.run(chooser, ThreadChooser.PERIOD + 3)
    assert used[-2:] == [2, 2] and chooser.choice == 2
    assert machine.run(ThreadChooser(1), 6) == [1] * 6  # one thread at most: nothing to choose


def test_a_chooser_with_a_baseline_ignores_one_slow_call_and_switches_on_a_steady_change() -> None:
    """tries=2, baseline=5 (what :class:`AutoThreads` uses): a call that takes 3× as long starts no
    try and wins none; a load that slows two threads for good moves the choice to one thread."""
    chooser, machine = ThreadChooser(2, period=100, tries=2, baseline=5), _Clock(two=1.0, one=1.3)
    used = machine.run(chooser, 40, spikes={10: 3.0, 25: 3.0})
    assert used[:6] == [2, 2, 2, 1, 2, 2]  # warm-up, two calls, a try that loses at once
    assert used.count(1) == 1 and chooser.choice == 2
    machine.rate = {2: 2.0, 1: 1.3}
    used = machine.run(chooser, 12)
    assert used == [2, 2, 2] + [1] * 9 and chooser.choice == 1  # the median moves after three slow calls


def test_a_try_that_wins_once_then_loses_keeps_the_choice() -> None:
    chooser = ThreadChooser(2, tries=2, baseline=3)
    for threads, seconds in ((2, 1.0), (2, 1.0), (2, 1.0)):  # warm-up and the baseline
        assert chooser.next() == threads
        chooser.record(threads, seconds, 1)
    assert chooser.next() == 1
    chooser.record(1, 0.9, 1)  # faster once ...
    assert chooser.next() == 1
    chooser.record(1, 1.1, 1)  # ... then not: the try ends
    assert chooser.next() == 2 and chooser.choice == 2


@pytest.mark.parametrize("kwargs, named", [({"most": 0}, "most"), ({"most": 2, "period": 0}, "period"),
                                           ({"most": 2, "tries": True}, "tries"),
                                           ({"most": 2, "baseline": 1.5}, "baseline")])
def test_bad_chooser_arguments_are_refused_by_name(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ThreadChooser(**kwargs)


# ---- the blocks -------------------------------------------------------------------------------------
class _Expert(nn.Linear):
    pass


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(_Expert(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(e(x) for e in self.experts)


class _Nested(nn.Module):
    """Two layers of three experts each, beside a 2-entry list of mixed classes (not blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(2))
        self.mixed = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])


def test_repeated_blocks_are_the_outermost_lists_of_one_class() -> None:
    model = _Nested()
    assert repeated_blocks(model) == [list(model.layers)]  # not the experts inside them, not the mixed list
    hf, patched = bench_generate.make_models(bench_generate.QUICK_MODELS["llama"])
    assert repeated_blocks(patched) == [list(patched.model.layers)]
    with pytest.raises(ValueError, match="pass blocks="):
        repeated_blocks(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        repeated_blocks("model")  # type: ignore[arg-type]


def test_a_vision_language_model_has_two_groups_and_an_encoder_one() -> None:
    """Qwen2-VL: its vision tower's blocks and its decoder's layers, judged apart; a patched BERT's
    layers give the same hidden states under auto_threads (its padded batch packed)."""
    from transformers import BertConfig, BertModel, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 64, "vocab_size": 200, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}}
    vl = Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config=text, vision_config={"depth": 2, "embed_dim": 32, "num_heads": 4, "hidden_size": 32}))
    assert [[type(b).__name__ for b in group] for group in repeated_blocks(vl)] == [
        ["Qwen2VLVisionBlock"] * 2, ["Qwen2VLDecoderLayer"] * 2]
    bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                intermediate_size=64)).eval()
    mh.hf.patch(bert)
    ids, mask = torch.randint(0, 100, (2, 9)), torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        expected = bert(input_ids=ids, attention_mask=mask).last_hidden_state
        with mh.auto_threads(bert) as auto:
            got = bert(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert sum(auto.calls.values()) == 3


def test_bad_blocks_are_refused_before_any_hook() -> None:
    model = _Nested()
    with pytest.raises(ValueError, match="twice"):
        mh.auto_threads(model, blocks=[model.layers[0], model.layers[0]])
    with pytest.raises(ValueError, match="at least one"):
        mh.auto_threads(model, blocks=[])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        mh.auto_threads(model, blocks=[model.layers[0], "block"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="torch.nn.Module"):
        mh.auto_threads(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="_Expert is inside a _Layer"):
        mh.auto_threads(model, blocks=[model.layers[0], model.layers[0].experts[1]])
    with pytest.raises(ValueError, match="not inside this _Nested"):
        mh.auto_threads(model, blocks=[model.layers[0], _Layer()])
    assert not model.layers[0]._forward_pre_hooks and not model.layers[0]._forward_hooks


# ---- auto_threads on models -------------------------------------------------------------------------
class _Timed(nn.Module):
    """A block whose call sleeps ``seconds[threads]`` (the test's machine) and records the threads it ran on."""

    def __init__(self, seconds: dict[int, float], seen: list[int]) -> None:
        super().__init__()
        self.seconds, self.seen = seconds, seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        threads = torch.get_num_threads()
        self.seen.append(threads)
        time.sleep(self.seconds[threads])
        return x + 1


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _stack(seconds: dict[int, float], seen: list[int], layers: int = 4) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList(_Timed(seconds, seen) for _ in range(layers))
    return model


def _passes(model: nn.Module, passes: int, x: torch.Tensor) -> None:
    for _ in range(passes):
        for layer in model.layers:
            x = layer(x)


@pytest.mark.parametrize("seconds, kept", [({2: 0.002, 1: 0.008}, 2), ({2: 0.008, 1: 0.002}, 1)])
def test_auto_threads_runs_the_blocks_on_the_faster_count_and_restores_torchs(
        two_threads: None, seconds: dict[int, float], kept: int) -> None:
    seen: list[int] = []
    model = _stack(seconds, seen)
    with mh.auto_threads(model) as auto:
        _passes(model, 6, torch.zeros(2, 3, 4))
        assert torch.get_num_threads() == 2  # outside a block call: torch's own count
    assert isinstance(auto, AutoThreads) and sum(auto.calls.values()) == len(seen) == 24
    assert auto.calls[kept] >= 18 and seen[-1] == kept  # a try of the other count every 16 calls
    assert torch.get_num_threads() == 2 and not model.layers[0]._forward_hooks  # hooks removed
    _passes(model, 1, torch.zeros(2, 3, 4))
    assert seen[-4:] == [2] * 4


def test_calls_of_other_sizes_get_their_own_chooser(two_threads: None) -> None:
    """A prefill's layer calls (many tokens) and a decoding step's (one) are judged apart."""
    seen: list[int] = []
    model = _stack({2: 0.001, 1: 0.004}, seen)
    with mh.auto_threads(model) as auto:
        _passes(model, 1, torch.zeros(1, 64, 4))
        _passes(model, 1, torch.zeros(1, 1, 4))
    assert seen == [2, 2, 2, 1] * 2 and len(auto._choosers) == 2


def test_a_failing_block_leaves_torchs_threads_as_they_were(two_threads: None) -> None:
    class Failing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    model = nn.Module()
    model.layers = nn.ModuleList([Failing(), Failing()])
    with pytest.raises(RuntimeError, match="boom"), mh.auto_threads(model):
        model.layers[0](torch.zeros(1, 2, 3))
    assert torch.get_num_threads() == 2 and not model.layers[0]._forward_pre_hooks


def test_a_block_called_without_hidden_states_is_refused_by_name(two_threads: None) -> None:
    model = _stack({2: 0.0, 1: 0.0}, [])
    with mh.auto_threads(model), pytest.raises(TypeError, match="_Timed was called without a tensor"):
        model.layers[0](3.0)
    auto = mh.auto_threads(model)
    with auto, pytest.raises(RuntimeError, match="already active"):
        auto.__enter__()


def test_generate_inside_auto_threads_gives_the_fixed_counts_tokens(two_threads: None) -> None:
    """A patched Llama with the in-place cache: greedy tokens equal with one thread, two, and auto
    (twice in a row, a fresh chooser each time); every layer call counted."""
    from multihead.interop.hf_cache import KVCacheAdapter

    hf, patched = bench_generate.make_models(bench_generate.QUICK_MODELS["llama"])
    ids, mask = bench_generate.make_prompts(hf.config.vocab_size, 12, 3)

    def generate() -> torch.Tensor:
        return patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                pad_token_id=0, cache=KVCacheAdapter(patched, max_len=17))

    fixed = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        fixed[threads] = generate()
    assert torch.equal(fixed[1], fixed[2])
    for _ in range(2):
        with mh.auto_threads(patched) as auto:
            assert torch.equal(generate(), fixed[2])
        assert sum(auto.calls.values()) == 5 * hf.config.num_hidden_layers  # a prefill and four steps
    assert torch.get_num_threads() == 2


def test_auto_threads_times_a_compiled_model_outside_its_graph(two_threads: None) -> None:
    seen: list[int] = []
    model = _stack({2: 0.0, 1: 0.0}, seen, layers=2)

    def run(x: torch.Tensor) -> torch.Tensor:
        for layer in model.layers:
            x = layer(x)
        return x

    compiled = torch.compile(run)
    with mh.auto_threads(model) as auto:
        out = compiled(torch.zeros(1, 2, 3))
    assert torch.equal(out, torch.full((1, 2, 3), 2.0)) and sum(auto.calls.values()) == 2
