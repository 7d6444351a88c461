""""auto"'s remembered decisions, and mh.attention's remembered backends, are the rules' own.

``auto.decision`` remembers the rule per ``auto.signature`` (with the machine facts it asked,
checked again before reuse), and ``mh.attention`` remembers per call signature which backend
(for "auto": which rule's path) it runs. Here: over a sweep of calls and machines, what is
remembered equals what the rules decide afresh (``auto.auto_path``, ``auto.fresh_decision``);
a change of any input of a signature, of a machine fact or of the registry is seen at once;
the rules read nothing of a call that is not in its signature; bad input raises what it raised
before, with the cache warm; the caches stay bounded and out of the way of ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import pytest
import torch

import multihead as mh
from multihead import functional
from multihead.backends import auto, gemm, native, registry
from multihead.logits import NO_FEATURES, Features


@pytest.fixture(autouse=True)
def _forgotten() -> None:
    """Every test starts with nothing remembered (and leaves what it taught behind cleared)."""
    auto.clear_decisions()
    functional._plans.clear()
    yield
    auto.clear_decisions()
    functional._plans.clear()


def _qkv(b: int, h: int, hkv: int, sq: int, sk: int, d: int = 64, dtype=torch.float32, dv: int | None = None):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, sq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, sk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, sk, dv or d, generator=g).to(dtype)
    return q, k, v


SHAPES = [(1, 12, 12, 16, 16, 32), (1, 32, 8, 1, 512, 128), (1, 4, 4, 8, 8, 64), (1, 4, 4, 64, 64, 64),
          (1, 8, 2, 1, 300, 64), (1, 8, 8, 1, 2048, 64), (2, 2, 2, 512, 512, 64), (1, 2, 2, 512, 512, 32),
          (1, 4, 1, 256, 256, 64), (1, 6, 2, 128, 128, 40)]
MACHINES = [(0, "AuthenticAMD", False, False), (256, "AuthenticAMD", False, False),
            (512, "AuthenticAMD", False, False), (512, "GenuineIntel", True, True),
            (512, "GenuineIntel", True, False), (128, "", False, False)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _machine(monkeypatch: pytest.MonkeyPatch, bits: int, vendor: str, amx_cpu: bool, tiles: bool) -> None:
    monkeypatch.setattr(native, "vector_bits", lambda: bits)
    monkeypatch.setattr(native, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(native, "amx_bf16", lambda: amx_cpu)
    monkeypatch.setattr(native, "amx", lambda: amx_cpu and tiles)


def _features(kind: str, h: int, s: int, grad: bool = False) -> Features:
    slopes = mh.logits.alibi_slopes(h).requires_grad_(grad)
    return {"none": NO_FEATURES, "softcap": Features(softcap=30.0), "alibi": Features(alibi_slopes=slopes),
            "sinks": Features(sinks=torch.zeros(h).requires_grad_(grad)),
            "packed": Features(cu_seqlens=torch.tensor([0, s // 2, s])),
            "all": Features(30.0, slopes, torch.zeros(h), torch.tensor([0, s // 2, s]))}[kind]


def _path(q, k, v, dropout_p=0.0, return_weights=False, return_lse=False, features=NO_FEATURES) -> str:
    given = {name: value for name, value in features._asdict().items()
             if name not in ("relative", "head_scale")}  # lowered only
    return auto.auto_path(q, k, v, dropout_p=dropout_p, return_weights=return_weights, return_lse=return_lse,
                          **given)


# -- (a) the remembered decision is the rules' decision --------------------------------------


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: f"{m[0]}-{m[1] or 'none'}-{m[2]}-{m[3]}")
def test_a_remembered_decision_equals_the_rules_over_a_sweep(monkeypatch: pytest.MonkeyPatch, machine) -> None:
    """Every signature decided twice (the second from memory) names the path auto_path names
    afresh, across dtypes, GQA, decoding, gradients, dropout, the lse, weights and features."""
    _machine(monkeypatch, *machine)
    seen = set()
    for shape, dtype in itertools.product(SHAPES, DTYPES):
        q, k, v = _qkv(*shape, dtype=dtype)
        s = q.shape[2]
        kinds = ["none", "softcap", "alibi", "sinks", "all"] + (["packed"] if s == k.shape[2] else [])
        for kind, grad, flags in itertools.product(kinds, ["none", "q", "k", "learned"],
                                                   [(0.0, False, False), (0.1, False, False), (0.0, False, True),
                                                    (0.0, True, False), (0.1, True, True)]):
            if grad == "learned" and kind not in ("alibi", "sinks"):
                continue
            features = _features(kind, q.shape[1], s, grad=grad == "learned")
            qq, kk = (q.clone().requires_grad_(), k) if grad == "q" else (q, k.clone().requires_grad_()) \
                if grad == "k" else (q, k)
            want = _path(qq, kk, v, *flags, features=features)
            for _ in range(2):  # the first decides and remembers, the second reads the memory
                got = auto.decision(qq, kk, v, *flags, features=features)
                assert got.rule.path == want, (shape, dtype, kind, grad, flags, machine)
            assert got == auto.decision(qq, kk, v, *flags, features=features)
            seen.add(want)
    assert len(seen) >= 6  # the sweep reaches many rules on every machine


@pytest.mark.parametrize("machine", MACHINES[:4], ids=lambda m: f"{m[0]}-{m[1]}")
def test_mh_attention_runs_the_backend_the_rules_and_registry_name(monkeypatch: pytest.MonkeyPatch, machine) -> None:
    """mh.attention's remembered backend for a call without features is resolve_backend's, and
    for "auto" the runner of the rule auto_path names; called twice, the memory is read."""
    _machine(monkeypatch, *machine)
    for shape, dtype, name in itertools.product(SHAPES[:6], DTYPES[:3] + [torch.float64],
                                                ["auto", "sdpa", "explicit"]):
        q, k, v = _qkv(*shape, dtype=dtype)
        for grad, (dropout_p, weights, lse) in itertools.product([False, True], [(0.0, False, False),
                                                                                (0.1, False, False),
                                                                                (0.0, False, True),
                                                                                (0.0, True, False)]):
            qq = q.clone().requires_grad_() if grad else q
            try:
                want = registry.resolve_backend(name, qq, k, v, dropout_p=dropout_p, return_weights=weights,
                                                return_lse=lse)
            except ValueError as refused:
                with pytest.raises(ValueError, match=re.escape(str(refused))):
                    functional._plan_for(name, (qq.shape, k.shape, v.shape, qq.dtype, qq.device), qq, k, v,
                                         dropout_p, weights, lse)
                continue
            if want is auto.auto_backend:
                want = next(r.run for r in auto.AUTO_RULES
                            if r.path == _path(qq, k, v, dropout_p, weights, lse))
            for _ in range(2):
                got = functional._plan_for(name, (qq.shape, k.shape, v.shape, qq.dtype, qq.device), qq, k, v,
                                           dropout_p, weights, lse).run
                assert got is want, (shape, dtype, name, grad, dropout_p, weights, lse)


@pytest.mark.parametrize("shape", [(1, 12, 12, 16, 16, 32), (1, 32, 8, 1, 512, 128), (1, 2, 2, 512, 512, 64)],
                         ids=["prefill", "decode", "long"])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"mask": "keys"}, {"window": 3}],
                         ids=["plain", "causal", "mask", "window"])
def test_the_fast_call_gives_the_numbers_of_the_path_it_names(shape, kw) -> None:
    """Bitwise: the remembered call (twice) is the named path's own result, masks and all."""
    q, k, v = _qkv(*shape)
    if kw.get("mask") == "keys":
        kw = {"mask": torch.rand(q.shape[0], 1, 1, k.shape[2], generator=torch.Generator().manual_seed(1)) < 0.7}
    path = auto.auto_path(q, k, v)
    with torch.no_grad():
        first, second = mh.attention(q, k, v, **kw), mh.attention(q, k, v, **kw)
        rule = next(r for r in auto.AUTO_RULES if r.path == path)
        want = rule.run(q, k, v, mask=functional._validate(q, k, v, kw.get("mask"), None, None, 0.0)[0],
                        causal=kw.get("causal", False), window=kw.get("window"), scale=q.shape[-1] ** -0.5,
                        dropout_p=0.0, return_weights=False, return_lse=False, features=NO_FEATURES)[0]
    assert torch.equal(first, want) and torch.equal(second, want), path


# -- (b) no stale decision ----------------------------------------------------------------------


def test_each_input_of_the_signature_changes_the_decision_where_the_rules_say(monkeypatch) -> None:
    """The same tensors, one input changed at a time, after the first decision is remembered."""
    _machine(monkeypatch, 256, "AuthenticAMD", False, False)
    q, k, v = _qkv(1, 2, 2, 8, 8, 32)  # 128 scores: below the native thresholds
    assert mh.attention(q, k, v) is not None and auto.decision(q, k, v).rule.path == "sdpa"
    leaf = q.clone().requires_grad_()
    assert auto.decision(leaf, k, v).rule.path == "sdpa (gradients)"
    with torch.no_grad():  # grad mode: the same leaf, no gradients
        assert auto.decision(leaf, k, v).rule.path == "sdpa"
    assert auto.decision(q, k, v, 0.1).rule.path == "sdpa (gradients)"  # dropout
    assert auto.decision(q, k, v, return_lse=True).rule.path == "explicit (lse)"
    assert auto.decision(q, k, v, return_weights=True).rule.path == "explicit"
    assert auto.decision(q, k, v, features=Features(softcap=5.0)).rule.path == "explicit (softcap)"
    sinks = torch.zeros(2)
    assert auto.decision(q, k, v, features=Features(sinks=sinks)).rule.path == "sdpa (bias)"
    with torch.no_grad():
        out = mh.attention(q, k, v, sinks=sinks.requires_grad_())
    assert auto.decision(q, k, v, features=Features(sinks=sinks)).rule.path == "sdpa (bias)"
    assert out.grad_fn is None
    big = _qkv(1, 4, 4, 1024, 1024)  # 2^22 scores: native on AVX2
    assert auto.decision(*big).rule.path == "native"
    assert auto.decision(*(t.double() for t in big)).rule.path == "sdpa"  # dtype
    assert auto.decision(*big[:2], big[2][..., :40]).rule.path != "native"  # Dv not a multiple of 16
    grads = [mh.attention(q.clone().requires_grad_(), k, v).grad_fn is not None for _ in range(2)]
    assert grads == [True, True]
    with torch.no_grad():
        assert mh.attention(leaf, k, v).grad_fn is None  # the remembered "sdpa (gradients)" is not reused


def test_a_mask_of_another_dtype_or_shape_is_checked_every_call() -> None:
    """Masks are not in the signature (no rule reads them) but are checked and applied every call:
    after a call without one, a bool mask applies, a float one is refused by name."""
    q, k, v = _qkv(1, 12, 12, 16, 16, 32)
    with torch.no_grad():
        plain = mh.attention(q, k, v)
        keys = torch.ones(1, 1, 1, 16, dtype=torch.bool)
        keys[..., 8:] = False
        masked = mh.attention(q, k, v, mask=keys)
        torch.testing.assert_close(masked, mh.attention(q, k[:, :, :8], v[:, :, :8]))  # the keys it sees
        assert not torch.equal(plain, masked)
        with pytest.raises(TypeError, match="mask must be a bool tensor"):
            mh.attention(q, k, v, mask=keys.float())
        with pytest.raises(ValueError, match=r"mask must be broadcastable to \[B, H, Sq, Sk\]"):
            mh.attention(q, k, v, mask=torch.ones(3, 16, dtype=torch.bool))


def test_the_thread_count_is_not_read_by_the_rules() -> None:
    """The rules decide on shapes, not threads: the remembered decision after a change of the
    thread count is still the rules' fresh one (and the same)."""
    q, k, v = _qkv(1, 32, 8, 1, 512, 128)
    before = torch.get_num_threads()
    want = auto.decision(q, k, v)
    try:
        for threads in (1, 2, before):
            torch.set_num_threads(threads)
            # the remembered one carries its prepared call (made once), a fresh one none
            assert auto.decision(q, k, v) == want == auto.fresh_decision(q, k, v, prepare=True)._replace(fast=want.fast)
            assert auto.fresh_decision(q, k, v).fast is None
            assert auto.decision(q, k, v).rule.path == auto.auto_path(q, k, v)
    finally:
        torch.set_num_threads(before)


def test_a_machine_fact_that_changes_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The build's width, the vendor, AMX and this machine's GEMM are asked again (or their
    functions' identity checked) before a remembered decision is reused."""
    _machine(monkeypatch, 0, "AuthenticAMD", False, False)  # no kernel
    step = _qkv(1, 8, 8, 1, 256)  # one query row per head, 2^11 scores: the decoding loop where it is built
    assert auto.decision(*step).rule.path == "sdpa"
    monkeypatch.setattr(native, "vector_bits", lambda: 512)
    assert auto.decision(*step).rule.path == "native decode" == auto.auto_path(*step)
    wide = _qkv(1, 2, 2, 512, 512, 72)  # D = 72: no native loop (not a multiple of 16); "blocked" on AMD
    assert auto.decision(*wide).rule.path == ("blocked" if gemm.onednn_available() else "sdpa")
    monkeypatch.setattr(native, "cpu_vendor", lambda: "GenuineIntel")  # Intel with AVX-512: never "blocked"
    assert auto.decision(*wide).rule.path == "sdpa" == auto.auto_path(*wide)
    half = _qkv(1, 8, 8, 512, 512, dtype=torch.bfloat16)  # 2^21 scores
    assert auto.decision(*half).rule.path == "native"
    monkeypatch.setattr(native, "amx_bf16", lambda: True)
    monkeypatch.setattr(native, "amx", lambda: True)
    assert auto.decision(*half).rule.path == "native"
    monkeypatch.setattr(native, "amx", lambda: False)  # native.amx_enabled(False), as the rules see it
    assert auto.decision(*half).rule.path == "sdpa" == auto.auto_path(*half)
    monkeypatch.setattr(native, "vector_bits", lambda: 0)  # no kernel
    long = _qkv(1, 2, 2, 512, 512)
    want = "blocked" if gemm.onednn_available() else "sdpa"
    assert auto.decision(*long).rule.path == want
    with torch.backends.mkldnn.flags(enabled=False):  # this machine's GEMM: torch.matmul now
        assert auto.decision(*long).rule.path == "sdpa" == auto.auto_path(*long)
        with torch.no_grad():
            assert functional._plan_for("auto", (long[0].shape, long[1].shape, long[2].shape, torch.float32,
                                                 long[0].device), *long, 0.0, False, False).run \
                is next(r.run for r in auto.AUTO_RULES if r.path == "sdpa")
    assert auto.decision(*long).rule.path == want


def test_a_small_call_asks_the_machine_nothing_it_need_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """A problem below every native threshold never asks for this machine's GEMM (nor builds the
    kernel), so its remembered decision is reused after checking at most the build's width."""
    asked = []
    monkeypatch.setattr(gemm, "onednn_available", lambda: asked.append("gemm") or True)
    q, k, v = _qkv(1, 2, 2, 8, 8, 32)  # 128 scores
    picked = auto.decision(q, k, v)
    assert picked.rule.path == "sdpa" and asked == []
    assert [name for _, name, *_ in picked.asked] in ([], ["vector_bits"])


def test_a_changed_table_needs_clear_decisions_and_then_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 256, "AuthenticAMD", False, False)
    q, k, v = _qkv(1, 1, 1, 33, 7)  # 33 rows per K/V head, 231 scores: below AVX2's 2^8
    assert mh.attention(q, k, v) is not None and auto.decision(q, k, v).rule.path == "sdpa"
    monkeypatch.setitem(auto.NATIVE_MIN_SCORES, 256, 1 << 7)
    auto.clear_decisions()
    assert auto.decision(q, k, v).rule.path == "native" == auto.auto_path(q, k, v)
    with torch.no_grad():
        assert functional._plan_for("auto", (q.shape, k.shape, v.shape, q.dtype, q.device), q, k, v,
                                    0.0, False, False).run is next(r.run for r in auto.AUTO_RULES
                                                                   if r.path == "native")


def test_a_backend_registered_again_or_no_longer_ready_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv(1, 2, 2, 8, 8)
    calls = []

    def first(q, k, v, **kw):
        calls.append("first")
        return torch.zeros_like(q), None, None

    def second(q, k, v, **kw):
        calls.append("second")
        return torch.ones_like(q), None, None

    monkeypatch.setitem(registry._SPECS, "spy", registry.BackendSpec("spy", first))
    mh.attention(q, k, v, backend="spy")
    mh.attention(q, k, v, backend="spy")
    monkeypatch.setitem(registry._SPECS, "spy", registry.BackendSpec("spy", second))
    assert mh.attention(q, k, v, backend="spy").min() == 1
    registry.register_backend("spy", first)
    mh.attention(q, k, v, backend="spy")
    assert calls == ["first", "first", "second", "first"]
    spec = registry.get_spec("spy")
    monkeypatch.setitem(registry._SPECS, "spy", dataclasses.replace(spec, ready=lambda: "switched off"))
    with pytest.raises(ValueError, match="backend 'spy' cannot do switched off"):
        mh.attention(q, k, v, backend="spy")
    with torch.no_grad():
        mh.attention(q, k, v, backend="native")  # remembered as able
    monkeypatch.setattr(native, "available", lambda: False)
    with pytest.raises(ValueError, match="backend 'native' cannot do running here: the native kernel is not"):
        mh.attention(q, k, v, backend="native")


# -- what the rules read is what the signature holds ---------------------------------------------


class _Watched:
    """A tensor whose attributes read are recorded (what a rule asks of the call's tensors)."""

    def __init__(self, t: torch.Tensor, seen: set[str]) -> None:
        object.__setattr__(self, "_t", t)
        object.__setattr__(self, "_seen", seen)

    def __getattr__(self, name: str):
        self._seen.add(name)
        return getattr(self._t, name)


def test_the_rules_read_of_a_call_only_what_its_signature_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rule's test run on calls whose tensors record what is read of them: only their
    shape, dtype, device and requires_grad, which auto.signature holds (with every flag)."""
    seen: set[str] = set()
    calls = []  # the watched calls, made once: each machine below runs every rule on each
    for shape, dtype, grad in itertools.product(SHAPES, DTYPES, [False, True]):
        q, k, v = _qkv(*shape, dtype=dtype)
        if grad:
            q = q.requires_grad_()
        watched = [_Watched(t, seen) for t in (q, k, v)]
        for flags, kind in itertools.product(
                [(0.0, False, False), (0.1, False, True), (0.0, True, False), (0.0, False, True)],
                ["none", "softcap", "alibi", "all"]):
            calls.append((watched, flags, _features(kind, q.shape[1], q.shape[2])))
    for machine in MACHINES:
        _machine(monkeypatch, *machine)
        for watched, flags, features in calls:
            call = auto._call(*watched, *flags, features)  # type: ignore[arg-type]
            for rule in auto.AUTO_RULES:  # every rule's test, not only up to the first that applies
                rule.applies(call)
    assert seen <= {"shape", "dtype", "device", "requires_grad"}, seen
    q, k, v = _qkv(1, 4, 2, 3, 5, d=8)
    key = auto.signature(q, k, v, 0.25, True, False, Features(softcap=1.0))
    assert key == (q.shape, k.shape, v.shape, q.dtype, q.device, False, 0.25, True, False,
                   (True, False, False, False, False, False, False))
    assert set(auto.Call.__slots__) == {"q", "k", "v", "dropout_p", "return_weights", "return_lse", "softcap",
                                        "alibi", "sinks", "varlen", "learned_grad", "bias", "score_mod",
                                        "differentiable", "logits", "few_rows", "few_keys", "scores", "asked",
                                        "symbolic"}  # a new field: extend auto.signature


# -- (c) bad input raises what it raised, with the caches warm ------------------------------------


def _bad(q, k, v):
    b, h, s, d = q.shape
    return [
        (dict(q=q.numpy()), TypeError, r"q must be a torch.Tensor, got ndarray"),
        (dict(k=k[0]), ValueError, r"k must have 4 dimensions, got 3"),
        (dict(v=v[None]), ValueError, r"v must have 4 dimensions, got 5"),
        (dict(q=q.long(), k=k.long(), v=v.long()), TypeError, r"q must be a floating-point tensor, got dtype"),
        (dict(k=k.double()), TypeError, r"k must have dtype torch.float32 like q, got torch.float64"),
        (dict(v=v.half()), TypeError, r"v must have dtype torch.float32 like q, got torch.float16"),
        (dict(v=torch.empty(v.shape, device="meta")), ValueError, r"v must be on device cpu like q, got meta"),
        (dict(k=k[..., :4]), ValueError, rf"k must have head dim {d} like q .*got 4"),
        (dict(v=v[:, :, :3]), ValueError, r"v must have shape \[B, Hkv, Sk, Dv\]"),
        (dict(k=torch.cat([k, k]), v=torch.cat([v, v])), ValueError, r"must share the batch size"),
        (dict(k=k[:, :5], v=v[:, :5]), ValueError, r"query heads \(12\) must be a multiple of .* \(5\)"),
        (dict(k=k[:, :0], v=v[:, :0]), ValueError, r"must be a multiple of the number of K/V heads \(0\)"),
        (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0.0, 1.0\), got 1.0"),
        (dict(dropout_p=math.nan), ValueError, r"dropout_p must be in \[0.0, 1.0\), got nan"),
        (dict(dropout_p="0"), TypeError, r"dropout_p must be a float, got str"),
        (dict(scale=0.0), ValueError, r"scale must be in \(0.0, inf\), got 0.0"),
        (dict(scale=math.inf), ValueError, r"scale must be in \(0.0, inf\), got inf"),
        (dict(scale=True), TypeError, r"scale must be a float, got bool"),
        (dict(window=0), ValueError, r"window must be in \[1, .*got 0"),
        (dict(window=2.0), TypeError, r"window must be an int, got float"),
        (dict(mask=torch.ones(s, s)), TypeError, r"mask must be a bool tensor"),
        (dict(mask=torch.ones(2, s, s, dtype=torch.bool)), ValueError, r"mask must be broadcastable"),
        (dict(backend="nope"), ValueError, r"backend must be one of .*got 'nope'"),
        (dict(backend="sdpa", return_lse=True), ValueError, r"backend 'sdpa' cannot do returning the log-sum-exp"),
        (dict(backend="sdpa", softcap=2.0), ValueError, r"backend 'sdpa' cannot do logit soft-capping"),
        (dict(sinks=torch.zeros(h), return_lse=True), ValueError, r"return_lse=True is not supported with sinks"),
        (dict(alibi_slopes=torch.zeros(h + 1)), ValueError, rf"alibi_slopes must have shape \[H\] = \[{h}\]"),
        (dict(cu_seqlens=torch.tensor([0, 3])), ValueError, r"cu_seqlens"),
    ]


@pytest.mark.parametrize("case", range(len(_bad(*_qkv(1, 12, 12, 16, 16, 32)))))
def test_bad_input_raises_the_same_error_with_the_caches_warm(case: int) -> None:
    q, k, v = _qkv(1, 12, 12, 16, 16, 32)
    for _ in range(2):  # remembered: the good call's plan and decision
        mh.attention(q, k, v)
        mh.attention(q, k, v, backend="sdpa")
    changed, error, message = _bad(q, k, v)[case]
    args = {"q": q, "k": k, "v": v, **changed}
    with pytest.raises(error, match=message):
        mh.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def _slow(t: object) -> object:
    """``t`` as a tensor subclass (the same values), which _validate checks one by one."""
    return torch.nn.Parameter(t, requires_grad=False) if isinstance(t, torch.Tensor) else t


def _outcome(*args: object) -> object:
    try:
        mask, scale, p, tensors = functional._validate(*args)
    except (TypeError, ValueError) as refused:
        return type(refused), str(refused)
    return mask, scale, type(scale), p, type(p), tensors


@pytest.mark.parametrize("case", range(len(_bad(*_qkv(1, 12, 12, 16, 16, 32)))))
def test_the_fast_checks_pass_exactly_the_calls_the_full_checks_pass(case: int) -> None:
    """_validate's one-expression path for plain tensors gives what the one-by-one checks give
    (the same tensors as a subclass), error or result: each bad input of mh.attention's checks."""
    q, k, v = _qkv(1, 12, 12, 16, 16, 32)
    changed = _bad(q, k, v)[case][0]
    args = {"q": q, "k": k, "v": v, "mask": None, "window": None, "scale": None, "dropout_p": 0.0, **changed}
    ordered = [args[key] for key in ("q", "k", "v", "mask", "window", "scale", "dropout_p")]
    fast = _outcome(*ordered)
    assert fast == _outcome(_slow(ordered[0]), *ordered[1:]) == _outcome(*ordered[:2], _slow(ordered[2]),
                                                                         *ordered[3:])
    if case < 12:  # the bad q, k or v: refused by the checks of the tensors
        assert isinstance(fast, tuple) and fast[0] in (TypeError, ValueError)


@pytest.mark.parametrize("scale", [None, 0.5, 2, 1e-30, -1.0, 0.0, math.nan, math.inf, True, "1", torch.tensor(0.5)])
@pytest.mark.parametrize("p", [0.0, 0.5, 0, 0.999, -0.0, 1.0, -1e-9, math.nan, False, "0", 1])
def test_the_fast_checks_agree_on_scale_and_dropout(scale: object, p: object) -> None:
    q, k, v = _qkv(1, 4, 2, 5, 7, 8)
    got = _outcome(q, k, v, None, None, scale, p)
    assert got == _outcome(_slow(q), k, v, None, None, scale, p)
    expected: list[object] = []
    for name, value, high in (("scale", scale, math.inf), ("dropout_p", p, 1.0)):
        if name == "scale" and value is None:
            expected.append(1 / math.sqrt(8))
            continue
        try:
            expected.append(mh._checks.check_float(name, value, low=0.0, high=high, low_inclusive=name != "scale",
                                                   high_inclusive=False))
        except (TypeError, ValueError) as refused:
            assert got == (type(refused), str(refused))
            return
    assert got[1:5] == (expected[0], float, expected[1], float)


def test_the_fast_checks_agree_on_good_calls() -> None:
    for shape, dtype, mask in itertools.product(SHAPES[:4], DTYPES, [None, "keys", "2d"]):
        q, k, v = _qkv(*shape, dtype=dtype)
        m = None if mask is None else torch.ones((1, 1, 1, k.shape[2]) if mask == "keys" else
                                                 (q.shape[2], k.shape[2]), dtype=torch.bool)
        got = functional._validate(q, k, v, m, 4, None, 0.0)
        assert got[3] == (q.shape, k.shape, v.shape, q.dtype, q.device)
        assert m is None or got[0].dim() == 4
        slow = functional._validate(_slow(q), k, v, m, 4, None, 0.0)
        assert (got[0] is None) == (slow[0] is None) and got[1:] == slow[1:]
        assert got[0] is None or torch.equal(got[0], slow[0])


# -- bounded, and out of a compiler's way ------------------------------------------------------------


def test_the_memories_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto, "DECISION_CACHE_SIZE", 4)
    monkeypatch.setattr(functional, "PLAN_CACHE_SIZE", 4)
    with torch.no_grad():
        for s in range(1, 12):
            q, k, v = _qkv(1, 2, 2, s, s, 8)
            assert torch.equal(mh.attention(q, k, v), mh.attention(q, k, v, backend="sdpa"))
            assert auto.decision(q, k, v).rule.path == auto.auto_path(q, k, v)
            assert len(auto._decisions) <= 4 and len(functional._plans) <= 4


def test_compiled_and_exported_attention_decide_afresh_and_match_eager() -> None:
    """Under torch.compile (dynamic shapes: symbolic sizes) and torch.export nothing is looked up
    or remembered, and the compiled call gives eager's numbers."""
    q, k, v = _qkv(1, 4, 4, 16, 16, 32)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = mh.attention(q, k, v, causal=True)
            auto.clear_decisions()
            functional._plans.clear()
            fn = torch.compile(lambda a, b, c: mh.attention(a, b, c, causal=True), fullgraph=True, dynamic=True)
            got = fn(q, k, v)
            longer = _qkv(1, 4, 4, 24, 24, 32)
            got_longer = fn(*longer)
            assert not auto._decisions and not functional._plans

            class Core(torch.nn.Module):
                def forward(self, a, b, c):
                    return mh.attention(a, b, c)

            seq = torch.export.Dim("seq", min=2, max=20)  # the rules' thresholds guard the range (2^11 scores)
            shapes = ({2: seq}, {2: seq}, {2: seq})
            program = torch.export.export(Core(), (q, k, v), dynamic_shapes=shapes)
            assert not auto._decisions and not functional._plans
            exported = program.module()(*_qkv(1, 4, 4, 20, 20, 32))
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_longer, mh.attention(*longer, causal=True), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(exported, mh.attention(*_qkv(1, 4, 4, 20, 20, 32)), rtol=1e-5, atol=1e-6)
