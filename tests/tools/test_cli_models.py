"""The ``multihead run``, ``explain CONFIG`` and ``cost`` commands, end to end, through
the command's entry ``main(argv)`` in this process (a subprocess would only add start-up time;
``python -m multihead`` itself is run by the start-up and install tests).
``--json`` output is parsed and its values checked.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from multihead import cli, models

CONFIGS = Path(__file__).parents[1] / "data" / "configs"


def _main_json(capsys, *args: str) -> dict:
    assert cli.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ---- run --------------------------------------------------------------------------------------
def test_run_json_on_the_bundled_minilm(capsys) -> None:
    assert cli.main(["run", "--json"]) == 0
    done = capsys.readouterr()
    info = json.loads(done.out)
    assert (info["embed_dim"], info["num_heads"], info["head_dim"]) == (384, 12, 32)
    assert info["batch"] == len(models.DEFAULT_TEXTS) and len(set(info["tokens"])) > 1
    assert info["min_cosine"] >= 0.99999
    assert info["max_abs_diff_hidden"] <= 1e-5
    assert info["unpatch_restored"] is True
    s = info["seq_len"]
    shapes = {r["tensor"]: r["shape"] for r in info["table"]}
    assert shapes["Q"] == f"[384, {s}]" and shapes["head_k"] == f"12 × [32, {s}]"
    assert "multihead run" in done.err  # the progress bar, on stderr only


def _tiny_llama_dir(tmp_path: Path) -> Path:
    """A random 2-layer Llama with GQA (h=4, h_kv=2) and MiniLM's tokenizer."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                         intermediate_size=64, vocab_size=30522, max_position_embeddings=128)
    torch.random.default_generator.manual_seed(0)
    state = {f"model.{k}": v.contiguous() for k, v in LlamaModel(config).state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))  # keys as a LlamaForCausalLM checkpoint has them
    config.save_pretrained(str(tmp_path))
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(models.bundled_model_dir() / name, tmp_path / name)
    return tmp_path


def test_run_any_checkpoint_directory_with_texts(tmp_path: Path, capsys) -> None:
    path = _tiny_llama_dir(tmp_path)
    info = _main_json(capsys, "run", "one", "two words here", "--model", str(path), "--no-progress")
    assert (info["embed_dim"], info["num_heads"], info["num_kv_heads"], info["head_dim"]) == (32, 4, 2, 8)
    assert info["causal"] and info["rope"] and info["batch"] == 2
    assert info["cosine_vs_sentence_transformers"] is None  # not a sentence-transformers model
    assert info["max_abs_diff_hidden"] <= 1e-5
    shapes = {r["tensor"]: r["shape"] for r in info["table"]}
    s = info["seq_len"]
    assert shapes["K"] == f"[16, {s}]" and shapes["K_k"] == f"2 × [8, {s}]" and shapes["RoPE(Q_k)"] == f"4 × [8, {s}]"


def test_run_times_both_sides_alternately_and_leaves_the_patch_in_place() -> None:
    """The per-layer times: TIMED_RUNS + 1 calls of every original and every wrapper, one model
    run each in turn (the first round not counted), the wrappers in the tree afterwards and no
    timing hook left on either side."""
    from transformers import BertConfig, BertModel

    from multihead import hf
    from multihead.tools import models as tool

    model = BertModel(BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                 num_hidden_layers=2)).eval()
    hf.patch(model)
    wrappers = {n: m for n, m in model.named_modules() if isinstance(m, hf.PatchedAttention)}
    order: list[str] = []
    for name, w in wrappers.items():
        w.original.register_forward_pre_hook(lambda *_, n=name: order.append(f"hf {n}"))
        w.register_forward_pre_hook(lambda *_, n=name: order.append(f"mh {n}"))
    timing = tool._time_layers(model, {"input_ids": torch.randint(0, 100, (2, 7))}, wrappers)
    ms_hf, ms_mh = timing["hf"], timing["multihead"]
    assert len(ms_hf) == len(ms_mh) == 2 and all(t > 0 for t in ms_hf + ms_mh)
    for side, medians in (("hf", ms_hf), ("multihead", ms_mh)):  # each median lies within its range
        assert all(lo <= m <= hi for m, (lo, hi) in zip(medians, timing["spread"][side]))
    assert timing["others"] is None or 0.0 <= timing["others"] <= 1.0
    one_round = [f"{side} {n}" for side in ("hf", "mh") for n in wrappers]
    assert order == one_round * (tool.TIMED_RUNS + 1)
    assert {n: m for n, m in model.named_modules() if isinstance(m, hf.PatchedAttention)} == wrappers
    for m in [*wrappers.values(), *(w.original for w in wrappers.values())]:
        timing = [h for h in m._forward_hooks.values() if h.__name__ != "output_capturing_hook"]  # not HF's
        assert timing == [] and len(m._forward_pre_hooks) == 1  # only this test's


def test_run_text_output_and_progress(tmp_path: Path, capsys) -> None:
    path = _tiny_llama_dir(tmp_path)
    assert cli.main(["run", "--model", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "max |diff|" in out and "single-head attention" in out and "layer 1:" in out
    assert "multihead run" in err


def test_run_rejects_a_missing_directory(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--model", str(tmp_path / "nope")])
    assert e.value.code == 2 and "nope" in capsys.readouterr().err


# ---- --threads ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-1", "x"])
@pytest.mark.parametrize("command", ["run", "heads", "bench", "embed"])
def test_timing_commands_refuse_a_bad_thread_count(capsys, command: str, value: str) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--threads", value])
    err = capsys.readouterr().err
    said = "a positive integer or auto" if command == "embed" else "a positive integer"  # embed --threads auto
    assert e.value.code == 2 and f"argument --threads: must be {said}, got '{value}'" in err


def test_run_uses_the_threads_asked_for_shows_them_and_restores_torchs(tmp_path: Path, capsys,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from multihead.tools import models as tool

    path = _tiny_llama_dir(tmp_path)
    before = torch.get_num_threads()
    seen: list[int] = []
    timed = tool._time_layers

    def time_layers(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return timed(*args, **kwargs)

    monkeypatch.setattr(tool, "_time_layers", time_layers)
    info = _main_json(capsys, "run", "one", "two", "--model", str(path), "--no-progress", "--threads", "1")
    assert info["threads"] == 1 and seen == [1] and torch.get_num_threads() == before
    assert cli.main(["run", "one", "--model", str(path), "--no-progress", "--threads", "1"]) == 0
    assert f"on {info['machine']['cpu']}, 1 torch thread):" in capsys.readouterr().out
    assert info["machine"]["torch_threads"] == 1


@pytest.mark.parametrize("competing", [False, True])
def test_run_competing_times_the_layers_beside_a_live_cpu_bound_process(tmp_path: Path, capsys, competing: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from multihead.tools import models as tool

    path = _tiny_llama_dir(tmp_path)
    alive: list[bool] = []
    real = tool.competing_process

    @contextlib.contextmanager
    def spy(on: bool = True):
        with real(on) as proc:
            yield proc
            alive.append(proc is not None and proc.poll() is None)  # still spinning when the timing ends

    monkeypatch.setattr(tool, "competing_process", spy)
    flag = ["--competing"] if competing else []
    info = _main_json(capsys, "run", "one", "two", "--model", str(path), "--no-progress", *flag)
    assert info["competing"] is competing and alive == [competing]
    assert cli.main(["run", "one", "--model", str(path), "--no-progress", *flag]) == 0
    said = "beside one competing CPU-bound process: other processes used"
    assert (said in capsys.readouterr().out) is competing


@pytest.mark.parametrize("others, said", [(0.37, "other processes used 37% of the CPUs meanwhile"),
                                          (None, "other processes' use of the CPUs is unknown")])
def test_the_competing_timing_says_what_share_others_used_or_that_it_is_unknown(others: float | None,
                                                                               said: str) -> None:
    info = {"ms_spread": {"hf": [(1.0, 2.0)], "multihead": [(0.5, 1.5)]}, "threads": 2,
            "machine": {"cpu": "Some CPU"}, "ms_per_layer": {"hf": [1.5], "multihead": [1.0]},
            "others_cpu_share": others, "competing": True, "packed": False}
    lines = models.timing_lines(info)
    assert "on Some CPU, 2 torch threads" in lines[0] and "layer 0: Hugging Face    1.50 ms (1.00-2.00)" in lines[1]
    assert lines[2] == f"  beside one competing CPU-bound process: {said} (the competing process included)"


def test_run_model_refuses_a_competing_that_is_not_a_bool() -> None:
    from multihead.tools.models import run_model

    with pytest.raises(TypeError, match="competing must be a bool, got str"):
        run_model(["one"], competing="yes")  # type: ignore[arg-type]


def test_heads_uses_the_threads_asked_for_and_shows_them(tmp_path: Path, capsys,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from multihead.heads import command

    before = torch.get_num_threads()
    seen: list[int] = []

    def run_heads(*args, **kwargs) -> dict:
        seen.append(torch.get_num_threads())
        return {"name": "tiny", "model": "dir", "texts": ["one"], "cut": [], "table": "TABLE", "wrote": []}

    monkeypatch.setattr(command, "run_heads", run_heads)
    assert cli.main(["heads", "one", "--threads", "1"]) == 0
    assert seen == [1] and torch.get_num_threads() == before
    assert "1 torch threads" in capsys.readouterr().out.splitlines()[0]
    assert _main_json(capsys, "heads", "one", "--threads", "1")["threads"] == 1


def test_bench_sets_the_threads_asked_for(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from multihead.tools import bench

    seen: list[int] = []

    def run_suite(**kwargs) -> dict:
        seen.append(torch.get_num_threads())
        raise ValueError("stop here")

    monkeypatch.setattr(bench, "run_suite", run_suite)
    before = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit):
            cli.main(["bench", "--quick", "--threads", "1"])
    finally:
        torch.set_num_threads(before)
    assert seen == [1] and "torch threads: 1" in capsys.readouterr().err


def test_torch_threads_is_checked_and_restored() -> None:
    before = torch.get_num_threads()
    with models.torch_threads(1) as used:
        assert used == torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with models.torch_threads(None) as used:
        assert used == before
    for bad, error in ((0, ValueError), (-1, ValueError), ("2", TypeError), (True, TypeError), (1.0, TypeError)):
        with pytest.raises(error, match="threads"):
            with models.torch_threads(bad):
                pass
    assert torch.get_num_threads() == before


# ---- explain CONFIG -----------------------------------------------------------------------------
def test_explain_llama3_config_shows_gqa_shapes(capsys) -> None:
    info = _main_json(capsys, "explain", str(CONFIGS / "meta-llama-3-8b.json"), "--seq", "256")
    assert (info["embed_dim"], info["num_heads"], info["num_kv_heads"], info["head_dim"]) == (4096, 32, 8, 128)
    assert info["kind"] == "GQA" and info["seq_len"] == 256
    shapes = {r["tensor"]: r["shape"] for r in info["table"]}
    assert shapes["Q"] == "[4096, 256]" and shapes["K"] == "[1024, 256]" and shapes["V"] == "[1024, 256]"
    assert shapes["Q_k"] == "32 × [128, 256]" and shapes["K_k"] == "8 × [128, 256]"
    assert shapes["RoPE(K_k)"] == "8 × [128, 256]" and shapes["X + O"] == "[4096, 256]"
    assert info["parameters_per_layer"] == 4096 * 4096 * 2 + 4096 * 1024 * 2


@pytest.mark.parametrize("name, d, h, causal", [
    ("bert-base-uncased.json", 768, 12, False), ("gpt2.json", 768, 12, True),
    ("vit-base-patch16-224.json", 768, 12, False),
])
def test_explain_reads_encoder_and_decoder_configs(capsys, name: str, d: int, h: int, causal: bool) -> None:
    info = _main_json(capsys, "explain", str(CONFIGS / name), "--seq", "8")
    assert (info["embed_dim"], info["num_heads"], info["config"]["causal"]) == (d, h, causal)
    assert {r["tensor"] for r in info["table"]}.isdisjoint({"RoPE(Q_k)"})


def test_explain_accepts_a_checkpoint_folder(tmp_path: Path, capsys) -> None:
    shutil.copy(CONFIGS / "mistral-7b-v0.1.json", tmp_path / "config.json")
    info = _main_json(capsys, "explain", str(tmp_path), "--seq", "16")
    assert info["num_kv_heads"] == 8 and info["config"]["window"] == 4096


def test_explain_text_names_the_model(capsys) -> None:
    assert cli.main(["explain", str(CONFIGS / "qwen2-7b.json"), "--seq", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("qwen2: d=3584, h=28, h_kv=4 (GQA), d_head=128, S=4")


def test_explain_rejects_a_malformed_config(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 64, ')
    with pytest.raises(SystemExit) as e:
        cli.main(["explain", str(bad)])
    assert e.value.code == 2 and "config.json" in capsys.readouterr().err


# ---- cost ---------------------------------------------------------------------------------------
def test_cost_json_matches_the_published_llama2_cache_size(capsys) -> None:
    info = _main_json(capsys, "cost", str(CONFIGS / "llama-2-7b.json"), "--seq", "4096", "--batch", "2",
                      "--dtype", "float16")
    assert info["kv_cache_bytes_per_token"] == 32 * 2 * 4096 * 2 == 512 * 1024
    assert info["kv_cache_bytes"] == 512 * 1024 * 4096 * 2
    assert info["gqa_saving"] == 1.0 and info["seq_len"] == 4096 and info["batch"] == 2


def test_cost_of_llama3_shows_the_gqa_saving(capsys) -> None:
    info = _main_json(capsys, "cost", str(CONFIGS / "meta-llama-3-8b.json"), "--seq", "8192", "--dtype", "bfloat16")
    assert info["kv_cache_bytes_per_token"] == 32 * 2 * 8 * 128 * 2  # 128 KiB
    assert info["gqa_saving"] == 4.0
    assert info["flops_attention"] > 0 and info["flops_projections"] > 0


def test_cost_text_output(capsys) -> None:
    assert cli.main(["cost", str(CONFIGS / "gpt2.json"), "--seq", "1024"]) == 0
    out = capsys.readouterr().out
    assert "KV cache per token" in out and "GQA saving" in out


@pytest.mark.parametrize("args, message", [
    (["--dtype", "float12"], "dtype"),
    (["--batch", "0"], "--batch"),
    (["--seq", "-3"], "--seq"),
])
def test_cost_rejects_bad_arguments(capsys, args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["cost", str(CONFIGS / "gpt2.json"), *args])
    assert e.value.code == 2 and message in capsys.readouterr().err



def test_run_times_our_side_packed_on_a_padded_encoder_batch() -> None:
    """The bundled encoder's batch is padded: our side runs it on its real tokens, and agrees."""
    from multihead.tools.models import run_model

    info = run_model(["a short one", "a somewhat longer sentence than the first, with more words"])
    assert info["packed"] is True and info["max_abs_diff_hidden"] < 1e-4
    assert info["min_cosine"] > 1 - 1e-5
