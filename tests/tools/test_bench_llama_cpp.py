"""llama.cpp as a peer of ``multihead bench --generate-jobs``: the GGUF writer, read back by the
``gguf`` package's own reader, llama-bench's output parsed, and the peer's rows in the job's table
(with stand-in ``llama-bench`` and ``llama-quantize`` programs: llama.cpp is built from its source,
so the suite does not have it; the performance page's figures come from the real one)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import numpy as np  # noqa: E402

from multihead.tools import bench_generate, bench_llama_cpp  # noqa: E402
from multihead.tools.cli import main  # noqa: E402

# A stand-in llama-bench: logs its argv, prints llama-bench's JSON rows for the test it was asked for
# (prompt rate 100 + depth, decode rate 10 per repetition index + 1); a stand-in llama-quantize copies.
_FAKE_BENCH = """\
import json, sys
argv = sys.argv[1:]
with open(__file__ + ".log", "a") as log:
    log.write(json.dumps(argv) + "\\n")
opt = dict(zip(argv[::2], argv[1::2]))
p, n, d, r = int(opt["-p"]), int(opt["-n"]), int(opt.get("-d", 0)), int(opt["-r"])
rate = [100.0 + d + i for i in range(r)] if p else [10.0 * (i + 1) for i in range(r)]
print(json.dumps([{"n_prompt": p, "n_gen": n, "n_depth": d, "avg_ts": sum(rate) / r, "samples_ts": rate}]))
"""
_FAKE_QUANTIZE = """\
import shutil, sys
assert sys.argv[3] == "Q8_0", sys.argv
with open(__file__ + ".log", "a") as log:
    log.write(sys.argv[1] + "\\n")
shutil.copyfile(sys.argv[1], sys.argv[2])
"""


def _program(path: Path, source: str) -> Path:
    path.write_text(f"#!{sys.executable}\n{source}", encoding="utf-8")
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_llama_cpp(tmp_path: Path) -> Path:
    """A folder with stand-ins for llama-bench and llama-quantize; returns llama-bench's path."""
    folder = tmp_path / "bin"
    folder.mkdir()
    _program(folder / "llama-quantize", _FAKE_QUANTIZE)
    return _program(folder / "llama-bench", _FAKE_BENCH)


def _model(name: str) -> Any:
    hf, _ = bench_generate.make_models(bench_generate.QUICK_MODELS[name])
    return hf


def _read(path: Path) -> tuple[dict[str, np.ndarray], Any]:
    """The file's tensors (name -> array in the writer's (rows, columns) order) and its reader."""
    reader = gguf.GGUFReader(str(path))
    shapes = {t.name: tuple(reversed([int(x) for x in t.shape])) for t in reader.tensors}  # GGUF lists ne0 first
    return {t.name: np.asarray(t.data).reshape(shapes[t.name]) for t in reader.tensors}, reader


def _field(reader: Any, key: str) -> Any:
    return reader.fields[key].contents()


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_the_gguf_holds_every_weight_and_the_hyperparameters(name: str, tmp_path: Path) -> None:
    """Read back by gguf's GGUFReader: every tensor equals the model's (Llama's q and k rows in the
    interleaved rotary order llama.cpp's llama architecture uses), the sizes, no output for tied embeddings."""
    model = _model(name)
    cfg, sizes = model.config, bench_generate.QUICK_MODELS[name]
    tensors, reader = _read(bench_llama_cpp.write_gguf(model, tmp_path / "m.gguf"))
    arch = _field(reader, "general.architecture")
    assert arch == name
    assert int(_field(reader, f"{arch}.block_count")) == sizes["layers"]
    assert int(_field(reader, f"{arch}.attention.head_count_kv")) == sizes["kv_heads"]
    assert int(_field(reader, f"{arch}.embedding_length")) == sizes["embed_dim"]
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == sizes["vocab"]
    layers = sizes["layers"]
    per_layer = 9 + (2 if name == "qwen3" else 0)
    assert len(tensors) == 2 + layers * per_layer + (0 if cfg.tie_word_embeddings else 1)
    assert ("output.weight" in tensors) == (not cfg.tie_word_embeddings)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert np.array_equal(tensors["blk.1.attn_v.weight"], attn.v_proj.weight.detach().numpy())
    assert np.array_equal(tensors["blk.1.ffn_down.weight"], mlp.down_proj.weight.detach().numpy())
    assert np.array_equal(tensors["token_embd.weight"], model.model.embed_tokens.weight.detach().numpy())
    q, D = attn.q_proj.weight.detach().numpy(), sizes["head_dim"]
    written = tensors["blk.1.attn_q.weight"]
    if name == "llama":  # head h's row 2j is HF's row j, row 2j + 1 HF's row j + D/2
        h, j = 1, 3
        assert np.array_equal(written[h * D + 2 * j], q[h * D + j])
        assert np.array_equal(written[h * D + 2 * j + 1], q[h * D + D // 2 + j])
        assert not np.array_equal(written, q)
    else:  # Qwen3 rotates halves in llama.cpp too, and carries its q/k norms
        assert np.array_equal(written, q)
        assert np.array_equal(tensors["blk.1.attn_k_norm.weight"], attn.k_norm.weight.detach().numpy())


def test_other_architectures_and_scaled_rotary_are_refused(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="model must be one of the model types.*'gpt2'"):
        bench_llama_cpp.write_gguf(gpt2, tmp_path / "g.gguf")
    scaled = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                          intermediate_size=32, vocab_size=32,
                                          rope_scaling={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(ValueError, match="plain rotary positions"):
        bench_llama_cpp.write_gguf(scaled, tmp_path / "s.gguf")
    biased = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                          intermediate_size=32, vocab_size=32, mlp_bias=True))
    with pytest.raises(ValueError, match="no biases.*'mlp_bias': True"):
        bench_llama_cpp.write_gguf(biased, tmp_path / "b.gguf")
    assert not any(tmp_path.iterdir())


def test_llama_bench_output_is_parsed_into_spreads() -> None:
    rows = [{"n_prompt": 64, "n_gen": 0, "n_depth": 0, "samples_ts": [100.0, 200.0, 160.0]},
            {"n_prompt": 0, "n_gen": 8, "n_depth": 64, "samples_ts": [20.0, 22.0, 21.0]},
            {"n_prompt": 0, "n_gen": 8, "n_depth": 0, "samples_ts": [99.0]}]
    rates = bench_llama_cpp.parse_llama_bench(rows, prompt=64, new_tokens=8)
    assert rates["decode_tokens_per_s"]["median"] == 21.0  # the test at depth 64, not at 0
    assert rates["prompt_tokens_per_s"] == {"median": 160.0, "min": 100.0, "max": 200.0,
                                            "values": [100.0, 200.0, 160.0]}
    assert rates["ttft_s"]["median"] == 64 / 160.0 and rates["ttft_s"]["max"] == 64 / 100.0
    with pytest.raises(ValueError, match="must hold pp64 and tg8 at depth 64"):
        bench_llama_cpp.parse_llama_bench(rows[:1], prompt=64, new_tokens=8)


def test_the_peer_times_f32_and_q8_files_with_the_jobs_threads(fake_llama_cpp: Path, tmp_path: Path) -> None:
    files = bench_llama_cpp.make_ggufs(fake_llama_cpp, _model("llama"), tmp_path / "work", threads=2)
    assert sorted(files) == ["F32", "Q8_0"] and all(f.stat().st_size > 0 for f in files.values())
    rates = bench_llama_cpp.llama_cpp_rates(fake_llama_cpp, files, prompt=12, new_tokens=4, threads=2, reps=3)
    assert list(rates) == ["llama.cpp, F32 GGUF", "llama.cpp, Q8_0 GGUF"]
    assert rates["llama.cpp, F32 GGUF"]["prompt_tokens_per_s"]["values"] == [100.0, 101.0, 102.0]  # empty cache
    assert rates["llama.cpp, Q8_0 GGUF"]["decode_tokens_per_s"]["median"] == 20.0
    calls = [json.loads(line) for line in Path(f"{fake_llama_cpp}.log").read_text().splitlines()]
    assert len(calls) == 4 and all(c[c.index("-t") + 1] == "2" and c[c.index("-r") + 1] == "3" for c in calls)
    assert [c[c.index("-m") + 1] for c in calls] == [str(files["F32"])] * 2 + [str(files["Q8_0"])] * 2


def test_without_llama_quantize_only_the_f32_file_is_timed(fake_llama_cpp: Path, tmp_path: Path) -> None:
    os.remove(fake_llama_cpp.with_name("llama-quantize"))
    assert list(bench_llama_cpp.make_ggufs(fake_llama_cpp, _model("llama"), tmp_path, threads=1)) == ["F32"]


def test_generate_jobs_put_the_peer_in_the_one_row_jobs_table(fake_llama_cpp: Path) -> None:
    """Each one-row job has the peer's rows, from GGUF files written once per model (two prompts here)."""
    result = bench_generate.run_generate_jobs(models=["llama"], prompts=[6, 12], quick=True, compiled=False,
                                              llama_bench=str(fake_llama_cpp))
    short, padded_short, one, padded = result["jobs"]
    assert "peers" not in padded and "peers" not in padded_short and short["peers"].keys() == one["peers"].keys()
    assert list(one["peers"]) == ["llama.cpp, F32 GGUF", "llama.cpp, Q8_0 GGUF"]
    written = fake_llama_cpp.with_name("llama-quantize.log").read_text().splitlines()
    assert len(written) == 1 and not Path(written[0]).exists()  # quantized once; the folder is gone after
    peer, base = one["peers"]["llama.cpp, F32 GGUF"], one["ways"][bench_generate.BASE]
    assert bench_generate.QUICK["reps"] == 1  # the stand-in's rates: prompt 100 tokens/s, decode 10
    assert peer["decode_speedup"] == pytest.approx(10.0 / base["decode_tokens_per_s"]["median"])
    assert peer["ttft_speedup"] == pytest.approx(base["ttft_s"]["median"] / (12 / 100.0))
    lines = bench_generate.format_generate_jobs(result).splitlines()
    q8_rows = [line for line in lines if line.strip().startswith("llama.cpp, Q8_0 GGUF")]
    f32_rows = [line for line in lines if line.strip().startswith("llama.cpp, F32 GGUF")]
    assert len(q8_rows) == len(f32_rows) == 2 and all(row.endswith("not compared") for row in q8_rows + f32_rows)
    assert f"{peer['decode_speedup']:.2f}x" in f32_rows[1]  # the job of 12 tokens, after the one of 6


def test_a_missing_llama_bench_is_refused_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def no_models(*args: Any) -> None:
        raise AssertionError("models built before the check")

    monkeypatch.setattr(bench_generate, "make_models", no_models)
    with pytest.raises(FileNotFoundError, match="llama_bench must be an executable file"):
        bench_generate.run_generate_jobs(quick=True, compiled=False, llama_bench=str(tmp_path / "none"))
    not_executable = tmp_path / "llama-bench"
    not_executable.write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--generate-jobs", "--quick", "--llama-bench", str(not_executable)])
    assert exit_.value.code == 2 and "llama_bench must be an executable file" in capsys.readouterr().err
    for extra in ([], ["--generate-jobs", "--curve"]):
        with pytest.raises(SystemExit):
            main(["bench", "--quick", *extra, "--llama-bench", str(not_executable)])
        assert "--llama-bench" in capsys.readouterr().err
