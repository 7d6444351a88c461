"""The router: capabilities refused by name before any work, and "auto"'s rules asserted directly.

No spies: each rule of AUTO_RULES is checked through auto_path on tensors that select
it, and "auto" is shown to run exactly that path by comparing its output bitwise with
the path's own kernel.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.backends import auto, blocked, native
from multihead.backends.gemm import onednn_available
from multihead.backends.registry import get_spec, missing_capability

def _qkv(b: int, h: int, hkv: int, sq: int, sk: int, d: int = 64, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, sk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, sk, d, generator=g).to(dtype)
    return q, k, v


def test_every_rule_has_a_reason_and_auto_paths_is_derived_from_the_rules() -> None:
    assert list(auto.AUTO_PATHS) == [r.path for r in auto.AUTO_RULES]
    assert all(r.reason for r in auto.AUTO_RULES)
    assert auto.AUTO_RULES[-1].applies(auto.Call(*_qkv(1, 1, 1, 1, 1)))  # a last rule that always applies


def test_weights_rule_comes_first() -> None:
    q, k, v = _qkv(1, 4, 4, 64, 64)
    assert auto.auto_path(q, k, v, return_weights=True) == "explicit"
    assert auto.auto_path(q.requires_grad_(), k, v, return_weights=True) == "explicit"


def test_gradients_and_dropout_take_sdpa_and_with_lse_explicit() -> None:
    q, k, v = _qkv(1, 4, 4, 64, 64)
    assert auto.auto_path(q, k, v, dropout_p=0.1) == "sdpa (gradients)"
    assert auto.auto_path(q.clone().requires_grad_(), k, v) == "sdpa (gradients)"
    assert auto.auto_path(q.clone().requires_grad_(), k, v, return_lse=True) == "explicit (gradients, lse)"
    with torch.no_grad():
        assert auto.auto_path(q.clone().requires_grad_(), k, v) != "sdpa (gradients)"


@pytest.mark.parametrize("bits", [512, 256], ids=["AVX-512", "AVX2"])
def test_native_rules_per_vector_width(monkeypatch, amd_cpu, bits: int) -> None:
    """Each width's thresholds (measured with its own tiles), asserted at their edges: the
    rules read the build's width and the CPU's vendor only, so both are checked on any machine."""
    monkeypatch.setattr(native, "vector_bits", lambda: bits)
    least, decode_least = auto.NATIVE_MIN_SCORES[bits], auto.NATIVE_MIN_DECODE_SCORES[bits]
    assert (least, decode_least) == {512: (1 << 8, 1 << 8), 256: (1 << 8, 1 << 8)}[bits]
    # float32 with few keys takes the decoding loop's rows-in-lanes path with the AVX-512 build
    few_keys = "native few keys" if bits == 512 else "native"
    rows = auto.DECODE_ROWS + 1  # (1, 1, 1, rows, keys): more rows than decoding, exactly `least` scores
    keys = -(-least // rows)
    assert auto.auto_path(*_qkv(1, 1, 1, rows, keys)) == few_keys
    assert rows * (keys - 1) < least and auto.auto_path(*_qkv(1, 1, 1, rows, keys - 1)) == "sdpa"
    assert auto.auto_path(*_qkv(1, 1, 1, 8, 8)) == "sdpa"  # 64 scores: below both widths' thresholds
    s = 64  # (1, 4, 4, 64, 64): 2^14 scores
    assert auto.auto_path(*_qkv(1, 4, 4, s, s)) == few_keys
    assert auto.auto_path(*_qkv(1, 4, 4, native.LANE_ROWS, native.LANE_KEYS)) == few_keys  # its edges
    assert auto.auto_path(*_qkv(1, 4, 4, native.LANE_ROWS + 1, native.LANE_KEYS)) == "native"
    assert auto.auto_path(*_qkv(1, 4, 4, s, native.LANE_KEYS + 1)) == "native"
    assert auto.auto_path(*_qkv(1, 4, 4, s, s, d=40)) != "native"  # Dv not a multiple of 16
    assert auto.auto_path(*_qkv(1, 4, 4, s, s, dtype=torch.bfloat16)) == "native"
    assert auto.auto_path(*_qkv(1, 4, 4, s, s, dtype=torch.float64)) == "sdpa"
    keys = decode_least // 8  # (1, 8, 2, 1, keys): Sq·G = 4 rows, exactly `decode_least` scores
    assert auto.auto_path(*_qkv(1, 8, 2, 1, keys)) == "native decode"
    assert auto.auto_path(*_qkv(1, 8, 8, 1, keys)) == "native decode"  # MHA too
    below = auto.auto_path(*_qkv(1, 8, 2, 1, keys - 1))
    assert below == ("decode" if keys - 1 >= auto.DECODE_MIN_KEYS else "sdpa")
    assert auto.auto_path(*_qkv(1, 8, 8, 1, keys - 1)) == "sdpa"  # MHA below: SDPA
    lse_least = auto.NATIVE_MIN_GRAD_LSE_SCORES[bits]
    assert lse_least == {512: 1 << 22, 256: 1 << 16}[bits]
    s = int(lse_least ** 0.5) // 2  # (1, 4, 4, s, s): exactly `lse_least` scores
    big = _qkv(1, 4, 4, s, s)
    assert auto.auto_path(big[0].clone().requires_grad_(), *big[1:], return_lse=True) == "native (gradients, lse)"
    small = _qkv(1, 4, 4, s - 1, s)
    assert auto.auto_path(small[0].clone().requires_grad_(), *small[1:], return_lse=True) \
        == "explicit (gradients, lse)"
    assert auto.auto_path(*big, return_lse=True, dropout_p=0.1) == "explicit (gradients, lse)"
    assert auto.auto_path(*_qkv(1, 4, 4, 1024, 1024)) == "native"


@pytest.mark.parametrize("bits", [512, 256], ids=["AVX-512", "AVX2"])
def test_native_gradients_per_vector_width(monkeypatch, bits: int) -> None:
    """Plain gradients: the native backward from the measured threshold (2^20 scores, both
    widths), SDPA below it and with dropout; bfloat16 on a CPU with AMX takes SDPA."""
    monkeypatch.setattr(native, "vector_bits", lambda: bits)
    monkeypatch.setattr(native, "amx_bf16", lambda: False)
    assert auto.NATIVE_MIN_GRAD_SCORES == {512: 1 << 20, 256: 1 << 20}
    s = 512  # (1, 4, 4, s, s): exactly 2^20 scores
    q, k, v = _qkv(1, 4, 4, s, s)
    grad = q.clone().requires_grad_()
    assert auto.auto_path(grad, k, v) == "native (gradients)"
    half = _qkv(1, 4, 4, s, s, dtype=torch.bfloat16)
    assert auto.auto_path(half[0].clone().requires_grad_(), *half[1:]) == "native (gradients)"
    monkeypatch.setattr(native, "amx_bf16", lambda: True)
    assert auto.auto_path(half[0].clone().requires_grad_(), *half[1:]) == "sdpa (gradients)"
    assert auto.auto_path(grad, k, v) == "native (gradients)"  # float32: AMX does not matter
    monkeypatch.setattr(native, "amx_bf16", lambda: False)
    assert auto.auto_path(q, k.clone().requires_grad_(), v) == auto.auto_path(grad, k, v)
    assert auto.auto_path(grad[:, :, 1:], k, v) == "sdpa (gradients)"  # one row fewer: below
    assert auto.auto_path(grad, k, v, dropout_p=0.1) == "sdpa (gradients)"
    lse_path = "native (gradients, lse)" if bits == 256 else "explicit (gradients, lse)"  # AVX-512: from 2^22
    assert auto.auto_path(grad, k, v, return_lse=True) == lse_path
    assert auto.auto_path(grad, k, v[..., :40]) == "sdpa (gradients)"  # Dv not a multiple of 16
    if bits == native.vector_bits() and native.available():  # the path taken here: its gradients
        grads = []
        for backend in ("auto", "sdpa"):
            leaf = q.clone().requires_grad_()
            mh.attention(leaf, k, v, causal=True, backend=backend).sum().backward()
            grads.append(leaf.grad)
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tiles", [True, False], ids=["loop on AMX", "loop not on AMX"])
@pytest.mark.parametrize("amx", [True, False], ids=["AMX", "no AMX"])
@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD", ""])
@pytest.mark.parametrize("bits", [512, 256], ids=["AVX-512", "AVX2"])
def test_intel_avx512_and_amx_rules(monkeypatch, bits: int, vendor: str, amx: bool, tiles: bool) -> None:
    """On an Intel CPU with AVX-512 (MKL's own AVX-512 code: measured) a forward never takes
    "blocked" (without the log-sum-exp); bfloat16 on a CPU with AMX takes the native loop
    from 2^21 scores where it runs on the tiles (native.amx()), SDPA below and where it cannot.
    Decoding, logit features and the log-sum-exp keep their native paths. Elsewhere, as before."""
    monkeypatch.setattr(native, "vector_bits", lambda: bits)
    monkeypatch.setattr(native, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(native, "amx_bf16", lambda: amx)
    monkeypatch.setattr(native, "amx", lambda: amx and tiles)
    intel = bits == 512 and vendor == "GenuineIntel"
    assert auto.intel_avx512() is intel
    s = 64  # (1, 4, 4, s, s): 2^14 scores, above the width's threshold
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        path = auto.auto_path(*_qkv(1, 4, 4, s, s, dtype=dtype))
        few_keys = "native few keys" if dtype == torch.float32 and bits == 512 else "native"
        assert path == ("sdpa" if dtype == torch.bfloat16 and amx else few_keys), (dtype, path)
    half = _qkv(1, 8, 8, 512, 512, dtype=torch.bfloat16)  # 2^21 scores
    assert auto.auto_path(*half) == ("sdpa" if amx and not tiles else "native")
    assert auto.auto_path(*_qkv(1, 8, 8, 511, 512, dtype=torch.bfloat16)) == (
        "sdpa" if amx else "native")
    assert auto.auto_path(half[0].clone().requires_grad_(), *half[1:]) == (
        "sdpa (gradients)" if amx else "native (gradients)")
    wide = _qkv(1, 4, 4, 1023, 1024)  # wide enough for "blocked": never on an Intel CPU with AVX-512
    assert auto.auto_path(*wide) == "native"
    monkeypatch.setitem(auto.NATIVE_MIN_SCORES, bits, 1 << 22)  # the native loop ruled out by size
    assert auto.auto_path(*wide) == ("blocked" if _blocked_fits(1023, 1024) and not intel else "sdpa")
    assert auto.auto_path(*wide, return_lse=True) == ("blocked" if _blocked_fits(1023, 1024) else "explicit (lse)")
    monkeypatch.undo()
    monkeypatch.setattr(native, "vector_bits", lambda: bits)
    monkeypatch.setattr(native, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(native, "amx_bf16", lambda: amx)
    monkeypatch.setattr(native, "amx", lambda: amx and tiles)
    assert auto.auto_path(*_qkv(1, 4, 4, 512, 512)) == "native"  # 2^20 scores: every threshold
    assert auto.auto_path(*_qkv(1, 2, 2, 256, 512)) == "native"  # 2^18 scores
    for dtype in (torch.float32, torch.bfloat16):
        assert auto.auto_path(*_qkv(1, 32, 8, 1, 4096, dtype=dtype)) == "native decode"
    assert auto.auto_path(*_qkv(1, 12, 12, 1024, 1024), softcap=30.0) == "native (features)"
    big = _qkv(1, 4, 4, 1024, 1024)
    assert auto.auto_path(big[0].clone().requires_grad_(), *big[1:], return_lse=True) \
        == "native (gradients, lse)"
    small = _qkv(1, 4, 4, 64, 64, dtype=torch.bfloat16)  # 2^14 scores: native with the lse, on any vendor
    assert auto.auto_path(*small, return_lse=True) == "native"
    smaller = _qkv(1, 1, 1, 33, 7, dtype=torch.bfloat16)  # 33 rows per K/V head, 231 scores: below both widths
    assert auto.auto_path(*smaller, return_lse=True) == "explicit (lse)"


def test_cpu_vendor_reads_proc_cpuinfo() -> None:
    import os
    vendor = native.cpu_vendor()
    assert isinstance(vendor, str)
    if os.path.exists("/proc/cpuinfo"):
        lines = [ln for ln in open("/proc/cpuinfo") if ln.startswith("vendor_id")]
        assert vendor == (lines[0].partition(":")[2].strip() if lines else "")


def _blocked_fits(sq: int, sk: int) -> bool:
    return min(sq, sk) >= auto.BLOCKED_MIN_SEQ and onednn_available()


@pytest.mark.parametrize("bits", [0, 128], ids=["no kernel", "no AVX2"])
def test_torch_rules_without_the_native_kernel(monkeypatch, bits: int) -> None:
    """Without the kernel, or built for a width whose tiles are not measured (128-bit
    vectors: the AVX2 tiles split), "auto" keeps to torch's paths."""
    monkeypatch.setattr(native, "vector_bits", lambda: bits)
    assert auto.auto_path(*_qkv(1, 8, 2, 1, 300)) == "decode"  # GQA, long cache
    assert auto.auto_path(*_qkv(1, 8, 8, 1, 300)) == "sdpa"  # MHA decoding: SDPA
    assert auto.auto_path(*_qkv(1, 8, 2, 1, 100)) == "sdpa"  # short cache
    long = _qkv(1, 2, 2, 512, 512)
    assert auto.auto_path(*long) == ("blocked" if onednn_available() else "sdpa")
    assert auto.auto_path(*_qkv(1, 2, 2, 512, 512, d=32)) == "sdpa"  # D < 64
    assert auto.auto_path(*_qkv(1, 12, 12, 2048, 2048)) != "native"


def test_the_machine_s_width_is_one_the_rules_know_or_none() -> None:
    """The rules above are keyed by width: this machine's build must be one of them (or
    take no native path at all), so the per-width tests cover what runs here."""
    bits = native.vector_bits()
    assert bits in (0, 128, 256, 512)
    path = auto.auto_path(*_qkv(1, 4, 4, 1024, 1024))
    assert (path == "native") == (bits in auto.NATIVE_MIN_SCORES), (bits, path)  # 2^22 scores: every rule


def test_lse_rules_never_pick_a_path_without_lse(monkeypatch) -> None:
    for bits in (0, 256, 512):
        monkeypatch.setattr(native, "vector_bits", lambda b=bits: b)
        for shape in ((1, 4, 4, 8, 8), (1, 8, 8, 1, 300), (1, 4, 4, 64, 64)):
            path = auto.auto_path(*_qkv(*shape), return_lse=True)
            assert "sdpa" not in path, (bits, shape, path)


def _run_named(path: str, q, k, v, causal: bool):
    scale = q.shape[-1] ** -0.5
    if path == "decode":
        return blocked.decode_attention(q, k, v, scale=scale, causal=causal)
    if path in ("native decode", "native few keys"):
        return native.run(q, k, v, scale=scale, causal=causal, window=None, mask=None, decode=True)[0]
    if path == "native":
        return native.run(q, k, v, scale=scale, causal=causal, window=None, mask=None, decode=False)[0]
    return mh.attention(q, k, v, causal=causal, backend=path.split(" (")[0])


@pytest.mark.parametrize("shape", [(1, 4, 4, 8, 8), (1, 4, 4, 64, 64), (1, 8, 2, 1, 300), (1, 2, 2, 512, 512)],
                         ids=["tiny", "mid", "gqa-decode", "long"])
def test_auto_runs_exactly_the_path_auto_path_names(shape) -> None:
    q, k, v = _qkv(*shape)
    path = auto.auto_path(q, k, v)
    ours = mh.attention(q, k, v, causal=True)
    assert torch.equal(ours, _run_named(path, q, k, v, True)), path


@pytest.mark.parametrize("name", ["blocked"])
def test_a_named_inference_backend_refuses_gradients_before_any_work(name: str) -> None:
    q, k, v = _qkv(1, 2, 2, 8, 8)
    q.requires_grad_()
    with pytest.raises(ValueError, match=rf"backend '{name}' cannot do gradients.*backends that can: .*'sdpa'"):
        mh.attention(q, k, v, backend=name)
    assert q.grad is None


def test_a_named_backend_refuses_dropout_dtype_lse_and_weights_by_name() -> None:
    q, k, v = _qkv(1, 2, 2, 8, 8)
    with pytest.raises(ValueError, match=r"backend 'native' cannot do dtype float64"):
        mh.attention(q.double(), k.double(), v.double(), backend="native")
    with pytest.raises(ValueError, match=r"backend 'blocked' cannot do dropout"):
        mh.attention(q, k, v, backend="blocked", dropout_p=0.1)
    with pytest.raises(ValueError, match=r"backend 'sdpa' cannot do returning the log-sum-exp"):
        mh.attention(q, k, v, backend="sdpa", return_lse=True)
    with pytest.raises(ValueError, match=r"backend 'native' cannot do returning attention weights"):
        mh.attention(q, k, v, backend="native", return_weights=True)


def test_native_refused_where_it_cannot_build(monkeypatch) -> None:
    monkeypatch.setattr(native, "available", lambda: False)
    q, k, v = _qkv(1, 2, 2, 8, 8)
    with pytest.raises(ValueError, match=r"backend 'native' cannot do running here: the native kernel is not"):
        mh.attention(q, k, v, backend="native")


def test_capability_table_matches_the_backends_docstring() -> None:
    rows = {name: get_spec(name) for name in ("explicit", "sdpa", "blocked", "native", "auto")}
    assert [n for n, s in rows.items() if s.weights] == ["explicit", "auto"]
    assert [n for n, s in rows.items() if s.lse] == ["explicit", "blocked", "native", "auto"]
    assert [n for n, s in rows.items() if s.grad] == ["explicit", "sdpa", "native", "auto"]
    q, k, v = _qkv(1, 2, 2, 4, 4)
    assert missing_capability(rows["auto"], q.requires_grad_(), k, v, dropout_p=0.5, return_weights=True,
                              return_lse=True) is None


def test_the_module_refuses_a_named_backend_before_writing_the_cache() -> None:
    layer = mh.MultiHeadAttention(32, 4, causal=True, backend="blocked")
    cache = layer.new_cache(1, 8)
    with pytest.raises(ValueError, match="cannot do gradients"):
        layer(torch.randn(1, 3, 32))  # a training call: parameters require grad
    with torch.no_grad():
        before = (cache.k.clone(), cache.lengths.clone())
        layer.dropout = 0.5
        layer.train()
        with pytest.raises(ValueError, match="cannot do dropout"):
            layer(torch.randn(1, 3, 32), cache=cache)
    assert torch.equal(cache.k, before[0]) and torch.equal(cache.lengths, before[1])
    assert cache.host_lengths() == [0]


# -- logit features and packed sequences ----------------------------------------------------


@pytest.mark.parametrize("bits", [512, 256], ids=["AVX-512", "AVX2"])
@pytest.mark.parametrize("kw", [dict(softcap=3.0), dict(alibi_slopes=torch.ones(4)), dict(sinks=torch.ones(4)),
                                dict(cu_seqlens=torch.tensor([0, 3, 100, 256])),
                                dict(alibi_slopes=torch.ones(4), return_lse=True)],
                         ids=["softcap", "alibi", "sinks", "packed", "alibi-lse"])
def test_auto_takes_native_for_features_where_native_runs_without_them(monkeypatch, amd_cpu, bits: int,
                                                                       kw: dict) -> None:
    """Logit features and packed sequences take the native FlashAttention loop wherever a native
    loop runs without them (same thresholds, per width), never with gradients (its backward
    applies none)."""
    monkeypatch.setattr(native, "vector_bits", lambda: bits)
    least, decode_least = auto.NATIVE_MIN_SCORES[bits], auto.NATIVE_MIN_DECODE_SCORES[bits]
    rows = auto.DECODE_ROWS + 1  # (1, 4, rows, keys): more query rows than the decoding loop takes
    keys = -(-least // (4 * rows))  # at least `least` scores; one key fewer is below
    q, kv = torch.randn(1, 4, rows, 16), torch.randn(1, 4, keys, 16)
    if "cu_seqlens" in kw:  # packed: as many keys as queries
        kw, kv = dict(cu_seqlens=torch.tensor([0, 3, rows - 5, rows])), q
    assert auto.auto_path(q, kv, kv) == ("native few keys" if bits == 512 else "native")
    assert auto.auto_path(q, kv, kv, **kw) == "native (features)"
    small = kv[:, :, : keys - 1]
    assert 4 * rows * (keys - 1) < least and auto.auto_path(q, small, small) != "native"
    if "cu_seqlens" not in kw:
        assert auto.auto_path(q, small, small, **kw) != "native (features)"
    assert auto.auto_path(q.clone().requires_grad_(), kv, kv, **kw) != "native (features)"  # the backward can't
    if "cu_seqlens" not in kw:  # few rows: at the decoding loop's threshold, the FlashAttention loop
        rows = torch.randn(1, 4, 1, 16)
        keys = torch.randn(1, 4, decode_least // 4, 16)
        assert auto.auto_path(rows, keys, keys) == "native decode"
        assert auto.auto_path(rows, keys, keys, **kw) == "native (features)"
        short = keys[:, :, : decode_least // 4 - 1]
        assert auto.auto_path(rows, short, short, **kw) != "native (features)"


def test_auto_runs_exactly_the_native_path_with_features() -> None:
    """Bitwise: "auto" on its native (features) rule is the native backend."""
    q, k, v = _qkv(1, 6, 2, 700, 700)
    kw = dict(softcap=4.0, alibi_slopes=mh.logits.alibi_slopes(6), sinks=torch.randn(6),
              cu_seqlens=torch.tensor([0, 300, 301, 700]))
    path = auto.auto_path(q, k, v, **kw)
    with torch.no_grad():
        got = mh.attention(q, k, v, causal=True, **kw)
        want = mh.attention(q, k, v, causal=True, backend="native" if path == "native (features)" else "explicit",
                            **kw)
    if path == "native (features)":
        assert torch.equal(got, want)
    else:  # no measured native width here: the torch paths, within rounding
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
