"""llama.cpp's CPU path as a peer of :mod:`multihead.tools.bench_generate`'s whole ``generate`` calls.

The benchmark's model (a Llama or Qwen3 of random weights, built from a config) is written as a GGUF
file, float32 (:func:`write_gguf`), then quantized to Q8_0 by ``llama-quantize`` where it lies beside
``llama-bench`` (:func:`make_ggufs`), and each file is timed by llama.cpp's ``llama-bench`` (:func:`llama_cpp_rates`):
the prompt's P tokens (``-p P``; the time to the first token is P over that rate) and N tokens decoded
after a context of P (``-p 0 -n N -d P``), one row, the benchmark's thread count, ``-r`` repetitions.

llama.cpp is not on PyPI as a binary: build ``llama-bench`` and ``llama-quantize`` from its source
(``cmake -B build -DGGML_NATIVE=ON && cmake --build build --target llama-bench llama-quantize``) and
pass the path of ``llama-bench``. Writing the GGUF takes the ``gguf`` package (``pip install gguf``).

Timing only: ``llama-bench`` feeds random token ids and prints no tokens, so the GGUF's outputs are not
compared with HF's. Its vocabulary is placeholders (the model's ids, no text).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import torch

from .bench import spread

__all__ = ["write_gguf", "make_ggufs", "llama_cpp_rates", "parse_llama_bench", "check_binary", "GGUF_ARCHS",
           "QUANTIZED"]

#: The transformers ``model_type`` -> GGUF architecture this writer knows.
GGUF_ARCHS = {"llama": "llama", "qwen3": "qwen3"}
#: The quantized type made with ``llama-quantize`` beside ``llama-bench`` (8 bits a weight, per block scales).
QUANTIZED = "Q8_0"
_TIMEOUT_S = 1800  # one llama-bench or llama-quantize call


def _rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """A q or k projection's weight (heads·D, E) with each head's rows from HF's half-split rotary
    order to the interleaved order llama.cpp's ``llama`` architecture rotates in."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _layer_tensors(model: Any, i: int, permute: bool) -> dict[str, torch.Tensor]:
    """Layer ``i``'s GGUF tensors (name -> float32 tensor) of a Llama or Qwen3 causal LM."""
    cfg, layer = model.config, model.model.layers[i]
    att, mlp = layer.self_attn, layer.mlp
    q, k = att.q_proj.weight, att.k_proj.weight
    out = {"attn_norm": layer.input_layernorm.weight,
           "attn_q": _rope_rows(q, cfg.num_attention_heads) if permute else q,
           "attn_k": _rope_rows(k, cfg.num_key_value_heads) if permute else k,
           "attn_v": att.v_proj.weight, "attn_output": att.o_proj.weight,
           "ffn_norm": layer.post_attention_layernorm.weight, "ffn_gate": mlp.gate_proj.weight,
           "ffn_up": mlp.up_proj.weight, "ffn_down": mlp.down_proj.weight}
    if hasattr(att, "q_norm"):  # Qwen3's per-head RMSNorm of q and k
        out.update(attn_q_norm=att.q_norm.weight, attn_k_norm=att.k_norm.weight)
    return {f"blk.{i}.{name}.weight": t for name, t in out.items()}


def write_gguf(model: Any, path: str | os.PathLike[str]) -> Path:
    """Write a transformers Llama or Qwen3 causal LM as a float32 GGUF file for llama.cpp.

    Args:
        model: ``LlamaForCausalLM`` or ``Qwen3ForCausalLM`` (``config.model_type`` in :data:`GGUF_ARCHS`).
        path: the file to write.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: another architecture, or a rotary scaling, bias or sliding window this writer does not carry.
        ModuleNotFoundError: the ``gguf`` package is not installed.
    """
    cfg = model.config
    arch = GGUF_ARCHS.get(getattr(cfg, "model_type", None))  # type: ignore[arg-type]
    if arch is None:
        raise ValueError(f"model must be one of the model types {sorted(GGUF_ARCHS)}, got "
                         f"{getattr(cfg, 'model_type', type(model).__name__)!r}")
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    unwritten = ("attention_bias", "mlp_bias", "use_sliding_window")  # settings this writer leaves out
    extras = {k: getattr(cfg, k) for k in unwritten if getattr(cfg, k, False)}
    if rope.get("rope_type", "default") != "default" or extras:
        raise ValueError(f"model must have plain rotary positions, no biases and no sliding window, got rope "
                         f"{rope.get('rope_type')!r}, {extras or 'no others'}")
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, cfg, float(rope["rope_theta"]))
    tensors = {"token_embd.weight": model.model.embed_tokens.weight}
    for i in range(cfg.num_hidden_layers):
        tensors.update(_layer_tensors(model, i, permute=arch == "llama"))
    tensors["output_norm.weight"] = model.model.norm.weight
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = model.lm_head.weight
    for name, t in tensors.items():
        writer.add_tensor(name, t.detach().float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _write_metadata(writer: Any, cfg: Any, rope_theta: float) -> None:
    """The GGUF's hyperparameters and a placeholder vocabulary of ``cfg.vocab_size`` ids."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta)
    writer.add_file_type(0)  # all float32
    vocab = cfg.vocab_size
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([b"<unk>", b"<s>", b"</s>"] + [f"<id {i}>".encode() for i in range(3, vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([2, 3, 3] + [1] * (vocab - 3))  # unknown, control, control, then normal
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


def parse_llama_bench(rows: list[dict[str, Any]], prompt: int, new_tokens: int) -> dict[str, Any]:
    """``llama-bench -o json``'s rows (of one or more runs) -> ``{"ttft_s", "prompt_tokens_per_s",
    "decode_tokens_per_s"}``,
    each ``{"median", "min", "max", "values"}`` over its repetitions (``ttft_s``: ``prompt`` over each
    prompt rate).

    Raises:
        ValueError: the output lacks the prompt test (``n_prompt`` = ``prompt`` on an empty cache) or the
            decode test (``n_gen`` = ``new_tokens`` at a depth of ``prompt``).
    """
    pp = [r for r in rows if r.get("n_prompt") == prompt and r.get("n_gen") == 0 and r.get("n_depth", 0) == 0]
    tg = [r for r in rows if r.get("n_prompt") == 0 and r.get("n_gen") == new_tokens
          and r.get("n_depth", 0) == prompt]
    if not pp or not tg:
        raise ValueError(f"llama-bench's output must hold pp{prompt} and tg{new_tokens} at depth {prompt}, got "
                         f"{[(r.get('n_prompt'), r.get('n_gen'), r.get('n_depth')) for r in rows]}")
    rates = {"prompt_tokens_per_s": pp[0]["samples_ts"], "decode_tokens_per_s": tg[0]["samples_ts"]}
    rates["ttft_s"] = [prompt / r for r in rates["prompt_tokens_per_s"]]
    return {name: spread([float(v) for v in values]) for name, values in rates.items()}


def make_ggufs(llama_bench: str | os.PathLike[str], model: Any, work_dir: str | os.PathLike[str],
               threads: int) -> dict[str, Path]:
    """``model`` written in ``work_dir`` as a float32 GGUF file and, where ``llama-quantize`` lies beside
    ``llama_bench``, quantized to :data:`QUANTIZED` with ``threads`` threads: ``{"F32": path, "Q8_0": path}``.

    Raises:
        FileNotFoundError: ``llama_bench`` is not an executable file.
        RuntimeError: llama-quantize failed (its last lines of output).
    """
    binary = check_binary(llama_bench)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    files = {"F32": write_gguf(model, work / "model-f32.gguf")}
    quantize = binary.with_name("llama-quantize")
    if quantize.is_file():
        files[QUANTIZED] = work / f"model-{QUANTIZED.lower()}.gguf"
        _run([str(quantize), str(files["F32"]), str(files[QUANTIZED]), QUANTIZED, str(threads)])
    return files


def llama_cpp_rates(llama_bench: str | os.PathLike[str], files: dict[str, Path], *, prompt: int, new_tokens: int,
                    threads: int, reps: int) -> dict[str, Any]:
    """Time each GGUF file of ``files`` (:func:`make_ggufs`) with ``llama-bench``: the prompt on an empty
    cache, then ``new_tokens`` decoded after ``prompt`` tokens; ``{"llama.cpp, F32 GGUF": rates, ...}``
    (:func:`parse_llama_bench`).

    Raises:
        FileNotFoundError: ``llama_bench`` is not an executable file.
        RuntimeError: llama-bench failed (its last lines of output).
    """
    binary = str(check_binary(llama_bench))
    common = ["-t", str(threads), "-r", str(reps), "-o", "json"]
    out = {}
    for kind, file in files.items():
        first = _run([binary, "-m", str(file), *common, "-p", str(prompt), "-n", "0"])
        then = _run([binary, "-m", str(file), *common, "-p", "0", "-n", str(new_tokens), "-d", str(prompt)])
        out[f"llama.cpp, {kind} GGUF"] = parse_llama_bench(json.loads(first) + json.loads(then), prompt, new_tokens)
    return out


def check_binary(llama_bench: str | os.PathLike[str]) -> Path:
    """``llama_bench`` as a Path, or FileNotFoundError where it is not an executable file."""
    binary = Path(llama_bench)
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise FileNotFoundError(f"llama_bench must be an executable file (llama.cpp's llama-bench), got {binary}")
    return binary


def _run(cmd: list[str]) -> str:
    """Run ``cmd``; its stdout, or RuntimeError with its last lines."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-5:])
        raise RuntimeError(f"{Path(cmd[0]).name} exited with {done.returncode}: {tail}")
    return done.stdout
