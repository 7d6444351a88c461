"""Hostile input across the public API: one table, each row a documented refusal.

Every row calls one public function with one bad input and expects a ``ValueError`` or
``TypeError`` (or ``FileNotFoundError`` for a missing file) whose message names the
argument, the field, the file or the tensor key. Rows that touch state also check that
nothing changed.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import multihead as mh
from multihead.config import AttentionConfig
from multihead.tools import cli
from multihead.tools.cost import cost
from multihead.interop import load_safetensors, load_state

Q = torch.randn(1, 4, 5, 8)
KV = torch.randn(1, 2, 5, 8)


def nan_at(shape: tuple[int, ...], index: tuple[int, ...], value: float = float("nan")) -> torch.Tensor:
    t = torch.randn(shape)
    t[index] = value
    return t


def layer(**kw) -> mh.MultiHeadAttention:
    torch.random.default_generator.manual_seed(0)
    return mh.MultiHeadAttention(16, 4, **kw)


@torch.no_grad()
def use_cache_of(owner: mh.MultiHeadAttention, other: mh.MultiHeadAttention) -> None:
    """Call ``other`` with a cache ``owner`` made (both alive, the same shape)."""
    other(torch.randn(1, 1, 16), cache=owner.new_cache(1, 4))


def write(tmp: Path, name: str, text: str) -> Path:
    p = tmp / name
    p.write_text(text)
    return p


LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "max_position_embeddings": 128, "rope_theta": 10000.0}


class Marker:
    """Unpickling this object would create a file: proof that nothing was unpickled."""

    path = ""

    def __reduce__(self):
        return (open, (self.path, "w"))


# (id, call(tmp_path) -> None, exception, regex the message must match)
ROWS: list[tuple[str, Callable[[Path], object], type[Exception], str]] = [
    # the functional core
    ("q_not_a_tensor", lambda t: mh.attention(Q.tolist(), KV, KV), TypeError, "q must be a torch.Tensor"),
    ("q_rank_3", lambda t: mh.attention(Q[0], KV, KV), ValueError, "q must have 4 dimensions"),
    ("q_integer", lambda t: mh.attention(Q.long(), KV.long(), KV.long()), TypeError, "q must be a floating"),
    ("k_dtype_mismatch", lambda t: mh.attention(Q, KV.double(), KV), TypeError, "k must have dtype"),
    ("k_head_dim_mismatch", lambda t: mh.attention(Q, KV[..., :4], KV), ValueError, "k must have head dim"),
    ("v_length_mismatch", lambda t: mh.attention(Q, KV, KV[:, :, :3]), ValueError, "v must have shape"),
    ("heads_not_multiple", lambda t: mh.attention(Q[:, :3], KV, KV), ValueError, "multiple of the number of K/V heads"),
    ("mask_float", lambda t: mh.attention(Q, KV, KV, mask=torch.zeros(5, 5)), TypeError, "mask must be a bool"),
    ("mask_shape", lambda t: mh.attention(Q, KV, KV, mask=torch.ones(3, 5, dtype=torch.bool)), ValueError, "mask must be broadcastable"),
    ("window_zero", lambda t: mh.attention(Q, KV, KV, window=0), ValueError, "window"),
    ("scale_negative", lambda t: mh.attention(Q, KV, KV, scale=-1.0), ValueError, "scale"),
    ("dropout_above_one", lambda t: mh.attention(Q, KV, KV, dropout_p=1.5), ValueError, "dropout_p"),
    ("unknown_backend", lambda t: mh.attention(Q, KV, KV, backend="flash9"), ValueError, "backend must be one of"),
    ("weights_from_sdpa", lambda t: mh.attention(Q, KV, KV, backend="sdpa", return_weights=True), ValueError, "weights"),
    ("nan_in_k", lambda t: mh.attention(Q, nan_at((1, 2, 5, 8), (0, 1, 3, 2)), KV, check_finite=True),
     ValueError, r"k has a non-finite value nan at index \[0, 1, 3, 2\]"),
    ("inf_in_v", lambda t: mh.attention(Q, KV, nan_at((1, 2, 5, 8), (0, 0, 4, 7), float("inf")), check_finite=True),
     ValueError, r"v has a non-finite value inf at index \[0, 0, 4, 7\]"),
    # the module
    ("embed_dim_negative", lambda t: mh.MultiHeadAttention(-5, 1), ValueError, "embed_dim"),
    ("num_heads_string", lambda t: mh.MultiHeadAttention(16, "4"), TypeError, "num_heads must be an int"),
    ("embed_dim_terabytes", lambda t: mh.MultiHeadAttention(2**40, 8), ValueError, "embed_dim must be in"),
    ("num_heads_absurd", lambda t: mh.MultiHeadAttention(16, 10**7), ValueError, "num_heads must be in"),
    ("rope_wrong_head_dim", lambda t: layer(rope=mh.RoPE(8)), ValueError, "rope.head_dim"),
    ("rope_not_a_rope", lambda t: layer(rope=10000.0), TypeError, "rope must be"),
    ("module_unknown_backend", lambda t: layer(backend="fast"), ValueError, "backend must be one of"),
    ("x_nan", lambda t: layer()(nan_at((1, 3, 16), (0, 2, 5)), check_finite=True), ValueError, r"x has a non-finite value nan at index \[0, 2, 5\]"),
    ("positions_float", lambda t: layer(rope=mh.RoPE(4))(torch.randn(1, 3, 16), positions=torch.arange(3.0)), TypeError, "positions must be an integer"),
    ("positions_without_rope", lambda t: layer()(torch.randn(1, 3, 16), positions=torch.arange(3)), ValueError, "positions"),
    ("key_mask_int", lambda t: layer()(torch.randn(2, 3, 16), key_mask=torch.ones(2, 3, dtype=torch.int64)), TypeError, "key_mask must be a bool"),
    ("context_batch", lambda t: layer()(torch.randn(2, 3, 16), torch.randn(3, 3, 16)), ValueError, "context must have batch size"),
    ("x_on_meta", lambda t: layer()(torch.randn(1, 3, 16, device="meta")), ValueError, "device"),
    ("x_float64_into_float32", lambda t: layer()(torch.randn(1, 3, 16, dtype=torch.float64)), TypeError, "x must have dtype"),
    ("rope_odd_rotary_dim", lambda t: mh.RoPE(8, rotary_dim=7), ValueError, "rotary_dim"),
    ("rope_base_zero", lambda t: mh.RoPE(8, base=0.0), ValueError, "base"),
    # the KV cache
    ("cache_terabytes", lambda t: layer().new_cache(2**20, 2**30), ValueError, "TiB"),
    ("cache_crop_negative", lambda t: layer().new_cache(1, 4).crop(-1), ValueError, "n must be in"),
    ("cache_crop_bool", lambda t: layer().new_cache(1, 4).crop(True), TypeError, "n must be an int, got bool"),
    ("cache_of_another_layer", lambda t: use_cache_of(layer(), layer()), ValueError, "cache belongs to another layer"),
    # config.json files
    ("config_malformed_json", lambda t: AttentionConfig.from_hf(write(t, "bad.json", "{hidden_size: 64")), ValueError, "bad.json"),
    ("config_truncated", lambda t: AttentionConfig.from_hf(write(t, "cut.json", json.dumps(LLAMA)[:40])), ValueError, "cut.json"),
    ("config_not_an_object", lambda t: AttentionConfig.from_hf(write(t, "list.json", "[1, 2]")), ValueError, "list.json"),
    ("config_missing_file", lambda t: AttentionConfig.from_hf(t / "nowhere.json"), ValueError, "nowhere.json"),
    ("config_string_size", lambda t: AttentionConfig.from_hf({**LLAMA, "hidden_size": "64"}), (TypeError, ValueError), "hidden_size"),
    ("config_missing_heads", lambda t: AttentionConfig.from_hf({k: v for k, v in LLAMA.items() if k != "num_attention_heads"}), ValueError, "num_attention_heads"),
    ("config_contradictory", lambda t: AttentionConfig.from_hf({**LLAMA, "n_embd": 128}), ValueError, "n_embd|hidden_size"),
    ("config_kv_not_dividing", lambda t: AttentionConfig.from_hf({**LLAMA, "num_key_value_heads": 3}), ValueError, "num_key_value_heads|num_kv_heads"),
    ("config_terabytes", lambda t: AttentionConfig.from_hf({**LLAMA, "hidden_size": 2**40, "num_attention_heads": 2**20}), ValueError, "hidden_size|embed_dim|num_heads"),
    ("config_boolean_size", lambda t: AttentionConfig.from_hf({**LLAMA, "num_hidden_layers": True}), (TypeError, ValueError), "num_hidden_layers|num_layers"),
    # cost
    ("cost_seq_len_zero", lambda t: cost(AttentionConfig.from_hf(LLAMA), 0), ValueError, "seq_len"),
    ("cost_unknown_dtype", lambda t: cost(AttentionConfig.from_hf(LLAMA), 16, dtype="float7"), ValueError, "dtype"),
    # masks
    ("alibi_is_not_a_mask", lambda t: mh.masks.from_additive(torch.tensor([[0.0, -1.5]])), ValueError, "bias"),
    # weights
    ("pickle_suffix_refused", lambda t: load_safetensors(t / "pytorch_model.bin"), ValueError, "pickle"),
    ("missing_weights_file", lambda t: load_safetensors(t / "absent.safetensors"), FileNotFoundError, "absent.safetensors"),
    ("not_a_safetensors_file", lambda t: load_safetensors(write(t, "junk.safetensors", "not safetensors")), ValueError, "junk.safetensors"),
    ("from_torch_of_a_linear", lambda t: mh.MultiHeadAttention.from_torch(torch.nn.Linear(4, 4)), TypeError, "MultiheadAttention"),
    ("fifo_as_weights", lambda t: load_safetensors(fifo(t / "model.safetensors")), ValueError, "model.safetensors: not a regular file \\(a FIFO\\)"),
    ("device_as_weights", lambda t: load_safetensors(link(t / "w.safetensors", "/dev/zero")), ValueError, "w.safetensors: not a regular file \\(a character device\\)"),
    ("fifo_shard", lambda t: load_safetensors(sharded(t, {"a": "s.safetensors"}, fifo_shard="s.safetensors")), ValueError, "s.safetensors: not a regular file \\(a FIFO\\)"),
    # sharded checkpoints: the index is not trusted
    ("shard_absolute", lambda t: load_safetensors(sharded(t, {"a": str(outside(t))})), ValueError, r"weight_map\['a'\] = '/.*' is not a file inside"),
    ("shard_dotdot", lambda t: load_safetensors(sharded(t, {"a": "../" + outside(t).name})), ValueError, r"weight_map\['a'\] = '\.\./.*' is not a file inside"),
    ("shard_subfolder_dotdot", lambda t: load_safetensors(sharded(t, {"a": "sub/../../x.safetensors"})), ValueError, r"weight_map\['a'\].* is not a file inside"),
    ("shard_dot", lambda t: load_safetensors(sharded(t, {"a": "."})), ValueError, r"weight_map\['a'\] must be a \.safetensors file name, got '\.'"),
    ("shard_symlink_out", lambda t: load_safetensors(sharded(t, {"a": "s.safetensors"}, link_shard="s.safetensors")), ValueError, r"weight_map\['a'\] = 's.safetensors' is not a file inside"),
    ("shard_not_a_string", lambda t: load_safetensors(sharded(t, {"a": 3})), ValueError, r"weight_map\['a'\] must be a \.safetensors file name, got 3"),
    ("weight_map_a_list", lambda t: load_safetensors(sharded(t, ["s.safetensors"])), ValueError, r"index.json: 'weight_map' must be a non-empty object"),
    ("weight_map_missing", lambda t: load_safetensors(sharded(t, None)), ValueError, r"index.json: 'weight_map' must be"),
    ("index_a_list", lambda t: load_safetensors(sharded(t, None, text="[1, 2]")), ValueError, r"index.json: 'weight_map' must be"),
    ("index_malformed", lambda t: load_safetensors(sharded(t, None, text='{"weight_map": {')), ValueError, r"index.json: not a safetensors index"),
    ("index_deeply_nested", lambda t: load_safetensors(sharded(t, None, text="[" * 100000)), ValueError, r"index.json: not a safetensors index"),
    ("tensor_listed_twice", lambda t: load_safetensors(sharded(t, None, text='{"weight_map": {"a": "s1.safetensors", "a": "s2.safetensors"}}')), ValueError, r"index.json: key 'a' is listed twice"),
    ("tensor_in_two_shards", lambda t: load_safetensors(sharded(t, {"a": "s1.safetensors", "b": "s2.safetensors"}, extra={"s2.safetensors": ["a"]})), ValueError, r"s2.safetensors: holds tensor 'a' but the index puts it in 's1.safetensors'"),
    ("tensor_missing_from_shard", lambda t: load_safetensors(sharded(t, {"a": "s1.safetensors", "b": "s1.safetensors"}, skip=["b"])), ValueError, r"s1.safetensors: lacks tensor 'b'"),
]


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def link(path: Path, target: str) -> Path:
    path.symlink_to(target)
    return path


def outside(tmp: Path) -> Path:
    """A valid safetensors file outside the checkpoint folder (``tmp / "ckpt"``)."""
    path = tmp / "outside.safetensors"
    save_file({"a": torch.zeros(1)}, str(path))
    return path


def sharded(tmp: Path, weight_map: object, *, text: str | None = None, extra: dict | None = None,
            skip: list[str] = (), fifo_shard: str | None = None, link_shard: str | None = None) -> Path:
    """A checkpoint folder ``tmp / "ckpt"``: its index (``weight_map`` or raw ``text``) and,
    for each well-formed shard name, a shard with the tensors the index lists there
    (less ``skip``, plus ``extra[shard]``)."""
    root = tmp / "ckpt"
    root.mkdir()
    index = {"metadata": {}} if weight_map is None else {"metadata": {}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index) if text is None else text)
    if isinstance(weight_map, dict):
        for shard in {v for v in weight_map.values() if isinstance(v, str) and "/" not in v and v != "."}:
            names = [k for k, v in weight_map.items() if v == shard and k not in skip]
            names += (extra or {}).get(shard, [])
            if shard == fifo_shard:
                os.mkfifo(root / shard)
            elif shard == link_shard:
                (root / shard).symlink_to(outside(tmp))
            else:
                save_file({n: torch.zeros(1) for n in names}, str(root / shard))
    return root


@pytest.mark.parametrize("call, exc, match", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input_is_refused_with_a_message_naming_it(tmp_path: Path, call, exc, match: str) -> None:
    with pytest.raises(exc, match=match):
        call(tmp_path)


def test_a_good_sharded_checkpoint_loads_every_shard(tmp_path: Path) -> None:
    root = sharded(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors", "c": "s2.safetensors"})
    assert sorted(load_safetensors(root)) == ["a", "b", "c"]


def test_the_table_is_large_enough() -> None:
    assert len(ROWS) + len(WEIGHT_ROWS) >= 30


def saved_layer_state(tmp_path: Path, mutate: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    state = {k: v.clone() for k, v in layer().state_dict().items()}
    mutate(state)
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    return path


# (id, mutate the saved state, regex naming the key)
WEIGHT_ROWS = [
    ("missing_tensor", lambda s: s.pop("k_proj.weight"), "missing tensor 'k_proj.weight'"),
    ("extra_tensor", lambda s: s.update({"lm_head.weight": torch.zeros(2, 2)}), "unexpected tensor 'lm_head.weight'"),
    ("misshaped_tensor", lambda s: s.update({"o_proj.weight": torch.zeros(16, 8)}), "'o_proj.weight' has shape"),
    ("misshaped_bias", lambda s: s.update({"q_proj.bias": torch.zeros(15)}), "'q_proj.bias' has shape"),
]


@pytest.mark.parametrize("mutate, match", [r[1:] for r in WEIGHT_ROWS], ids=[r[0] for r in WEIGHT_ROWS])
def test_bad_weight_files_name_the_key_and_leave_the_layer_unchanged(tmp_path: Path, mutate, match: str) -> None:
    path = saved_layer_state(tmp_path, mutate)
    target = mh.MultiHeadAttention(16, 4)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        load_state(target, load_safetensors(path))
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_good_weight_file_loads(tmp_path: Path) -> None:
    path = saved_layer_state(tmp_path, lambda s: None)
    target = load_state(mh.MultiHeadAttention(16, 4), load_safetensors(path))
    assert torch.equal(target.q_proj.weight, layer().q_proj.weight)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.safetensors", "model.pt"])
def test_a_pickle_offered_as_weights_is_never_unpickled(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "UNPICKLED"
    Marker.path = str(marker)
    (tmp_path / name).write_bytes(pickle.dumps(Marker()))
    with pytest.raises(ValueError, match="pickle|safetensors"):
        load_safetensors(tmp_path / name)
    with pytest.raises(ValueError):
        load_safetensors(tmp_path) if name != "model.safetensors" else load_safetensors(tmp_path / name)
    assert not marker.exists(), "the pickle was executed"
    assert not os.path.exists(Marker.path)


@torch.no_grad()
def test_cache_overflow_leaves_the_cache_unchanged() -> None:
    lay = layer(causal=True).eval()
    cache = lay.new_cache(1, 4)
    lay(torch.randn(1, 3, 16), cache=cache)
    k = cache.k.clone()
    with pytest.raises(ValueError, match="overflow"):
        lay(torch.randn(1, 2, 16), cache=cache)
    assert cache.host_lengths() == [3] and torch.equal(cache.k, k)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["cost", "missing-config.json"], "missing-config.json"),
        (["cost", "tests/data/configs/gpt2.json", "--seq", "0"], "seq"),
        (["cost", "tests/data/configs/gpt2.json", "--dtype", "float7"], "dtype"),
        (["explain", "--seq", "-3"], "seq"),
        (["run", "--model", "no-such-dir"], "no-such-dir"),
    ],
    ids=["cost-missing-file", "cost-seq-zero", "cost-bad-dtype", "explain-negative-seq", "run-missing-model"],
)
def test_cli_refuses_bad_arguments_with_exit_code_2(argv: list[str], match: str, capsys: pytest.CaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's own entry (``multihead.cli.main``, what ``python -m multihead`` calls) in this
    process: status 2 and one line on stderr, no traceback."""
    import re

    monkeypatch.chdir(Path(__file__).parents[2])
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert re.search(match, err), err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["explain", "--seq", str(10**9)], r"--seq must be at most 4096 when the seed's example runs"),
        (["explain", "--seq", "100000"], r"--seq must be at most 4096 when the seed's example runs"),
        (["explain", "tests/data/configs/gpt2.json", "--seq", str(2**20 + 1)], r"--seq must be at most 1048576"),
        (["explain", "no-such-config.json", "--seq", str(10**9)], r"--seq must be at most 1048576"),
    ],
    ids=["seed-1e9", "seed-1e5", "config-above-2^20", "refused-before-reading-the-config"],
)
def test_explain_bounds_seq_up_front_with_one_line_and_exit_code_2(argv, match, capsys, monkeypatch) -> None:
    from multihead.tools import cli, explain

    def no_work(*args, **kw):
        raise AssertionError("the bound must be checked before any work")

    monkeypatch.setattr(explain, "explain_seed", no_work)
    monkeypatch.setattr(explain, "explain_config", no_work)
    monkeypatch.chdir(Path(__file__).parents[2])
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and re.search(match, err), err
    assert len(err.strip().splitlines()) == 1, err


def test_the_library_bounds_explain_seq_len_too() -> None:
    from multihead.tools.explain import explain_config, explain_seed

    with pytest.raises(ValueError, match=r"seq_len must be in \[1, 4096\], got 100000"):
        explain_seed(100_000)
    with pytest.raises(ValueError, match=r"seq_len must be in \[1, 1048576\]"):
        explain_config("no-such-config.json", 2**20 + 1)
