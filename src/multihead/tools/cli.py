"""The ``multihead`` command: a thin ``main(argv)`` over library calls.

    multihead explain                   the seed's section-7 example (d=768, h=12, S=1024)
    multihead explain CONFIG|DIR        the same table for a real config, on meta tensors
    multihead explain --html PATH       the lesson as one offline page on real tensors (MiniLM's first layer)
    multihead cost CONFIG|DIR           parameters, FLOPs and KV-cache bytes of a config
    multihead run [TEXT ...]            the bundled MiniLM (or --model DIR), patched and checked
    multihead bench [--quick]           multihead against torch and Hugging Face on this machine
    multihead heads [TEXT ...]          what each head of the bundled MiniLM does (table, page, picture)
    multihead embed FILE                sentence embeddings of a file's lines (.npy or .jsonl), as sentence-transformers
    multihead build [--machine]         which build of the native kernels runs here (or compile this machine's)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Each subcommand imports what it needs when it runs (torch, the layer, transformers): the command
# itself, its help and its refusals of bad arguments import none of them.
from .. import __version__
from .seed import SEED_SEQ_LEN, max_seq_len


def _positive_int(value: str) -> int:
    """argparse type of ``--threads`` and ``--batch-size``: a positive integer, else a refusal naming it."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return number


def _threads_or_auto(value: str) -> int | str:
    """argparse type of ``embed --threads``: a positive integer or ``auto``, else a refusal naming it."""
    if value == "auto":
        return "auto"
    try:
        return _positive_int(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a positive integer or auto, got {value!r}") from None


def _emit(args: argparse.Namespace, payload: dict[str, Any], text: str) -> None:
    print(json.dumps(payload, indent=2) if args.json else text)


def cmd_explain(args: argparse.Namespace) -> int:
    if args.html is not None:
        if args.seq != SEED_SEQ_LEN:
            raise ValueError("--seq does not apply with --html: the page has one token per token of --text")
        return _explain_page(args)
    for flag, value in (("--text", args.text), ("--model", args.model), ("--max-bytes", args.max_bytes),
                        ("--random", args.random or None)):
        if value is not None:
            raise ValueError(f"{flag} applies only with --html PATH")
    if args.config is not None:
        return _explain_config(args)
    from .explain import explain_seed

    info = explain_seed(args.seq)
    text = "\n".join([
        f"The seed's example: d={info['embed_dim']}, h={info['num_heads']}, "
        f"d_head={info['head_dim']}, S={info['seq_len']} (causal, RoPE, random weights)",
        "",
        info["table_text"],
        "",
        f"parameters: {info['parameters']:,} ({info['parameters_formula']})",
        f"float32 layer vs float64 reference: max |diff| = {info['max_abs_error_vs_float64_reference']:.2e} "
        f"(outputs up to {info['output_scale']:.2e})",
    ])
    payload = {k: v for k, v in info.items() if k != "table_text"}
    _emit(args, payload, text)
    return 0


def _explain_page(args: argparse.Namespace) -> int:
    """``explain --html PATH``: the lesson as one offline page (:func:`~multihead.tools.explain_page.explain_page`)."""
    from .explain_page import DEFAULT_MAX_BYTES, DEFAULT_TEXT, explain_page

    info = explain_page(args.html, text=DEFAULT_TEXT if args.text is None else args.text, model_dir=args.model,
                        config=args.config, random=args.random,
                        max_bytes=DEFAULT_MAX_BYTES if args.max_bytes is None else args.max_bytes)
    text = "\n".join([
        f"wrote {info['path']} ({info['bytes']:,} bytes): {info['source']}",
        f"d={info['embed_dim']}, h={info['num_heads']}, d_head={info['head_dim']}, S={info['seq_len']} tokens",
        "max |ours - float64 reference| per step:",
        *(f"  {step:<11} {dist:.2e}" for step, dist in info["distances"].items()),
    ])
    _emit(args, info, text)
    return 0


def _explain_config(args: argparse.Namespace) -> int:
    from .explain import explain_config, format_layer_kinds

    info = explain_config(args.config, args.seq)
    c = info["config"]
    text = "\n".join([
        f"{c['model_type'] or args.config}: d={info['embed_dim']}, h={info['num_heads']}, "
        f"h_kv={info['num_kv_heads']} ({info['kind']}), d_head={info['head_dim']}, S={info['seq_len']}, "
        f"{'causal' if c['causal'] else 'bidirectional'}, {'RoPE' if c['rope_base'] else 'no RoPE'} "
        "(shapes on meta tensors: no weights loaded)",
        "",
        info["table_text"],
        "",
        f"parameters per layer: {info['parameters_per_layer']:,}",
        "",
        "layer kinds (the table above is layer 0's):",
        format_layer_kinds(info["layer_kinds"]),
    ])
    _emit(args, {k: v for k, v in info.items() if k != "table_text"}, text)
    return 0


def cmd_cost(args: argparse.Namespace) -> int:
    from .cost import cost

    result = cost(args.config, args.seq, batch=args.batch, dtype=args.dtype)
    _emit(args, result.to_dict(), result.format(per_layer=args.per_layer))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from .models import run_model, timing_lines

    info = run_model(args.text or None, args.model, progress=not args.no_progress, threads=args.threads,
                     competing=args.competing)
    cos = info["cosine_vs_sentence_transformers"]
    text = "\n".join([
        f"{info['model_type']} from {info['model_dir']}",
        f"d={info['embed_dim']}, h={info['num_heads']}, h_kv={info['num_kv_heads']}, d_head={info['head_dim']}, "
        f"S={info['seq_len']} (batch of {info['batch']}, tokens {info['tokens']}), "
        f"{info['patched_layers']} attention layers patched",
        "",
        "layer 0, observed on the real hidden states:",
        info["table_text"],
        "",
        f"patched vs unpatched hidden states (real tokens, all layers): max |diff| = "
        f"{info['max_abs_diff_hidden']:.2e}",
        ("sentence embeddings vs sentence-transformers encode: cosine " +
         ", ".join(f"{c:.6f}" for c in cos)) if cos is not None else "not a sentence-transformers model",
        f"unpatch restored the original modules: {info['unpatch_restored']}",
        *timing_lines(info),
    ])
    _emit(args, {k: v for k, v in info.items() if k != "table_text"}, text)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from . import bench

    if args.threads is not None:  # positive: _positive_int
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}", file=sys.stderr, flush=True)
    if args.hf_generate:
        return _bench_hf_generate(args)
    if args.generate_jobs:
        return _bench_generate_jobs(args)
    if args.flex:
        return _bench_flex(args)
    if args.embed:
        return _bench_embed(args)
    if not args.quick:  # a quiet moment: this machine's GEMM measured again and kept (gemm_choice)
        from ..backends.gemm import keep_gemm_measurement

        keep_gemm_measurement()
    suite = bench.run_suite(quick=args.quick,
                            progress=lambda line: print(f"  running {line}", file=sys.stderr, flush=True))
    out = Path(args.out)
    written = [str(bench.write_json(suite, out / "bench.json"))]
    try:
        written.append(str(bench.plot(suite, out / "bench.png")))
    except ImportError:  # matplotlib is the optional [bench] extra
        pass
    _emit(args, suite, bench.format_report(suite) + "\n\nwrote " + " and ".join(written))
    return 0


def _bench_hf_generate(args: argparse.Namespace) -> int:
    """``bench --hf-generate``: a whole transformers model, unpatched vs patched vs KVCacheAdapter; with
    ``--families``, each family's decoding step (exit 1 when one's logits differ from HF's or it failed)."""
    from . import bench_hf, bench_hf_families

    if args.families is not None:
        fam = bench_hf_families.run_hf_families(args.families, quick=args.quick, reps=args.reps, progress=_say)
        _write_result(args, fam, "hf_generate_families.json", bench_hf_families.format_hf_families(fam))
        return 1 if fam["mismatches"] or fam["failed"] else 0
    result = bench_hf.run_hf_generate(quick=args.quick, compiled=args.compiled, progress=_say)
    return _write_result(args, result, "hf_generate.json", bench_hf.format_hf_generate(result))


def _bench_generate_jobs(args: argparse.Namespace) -> int:
    """``bench --generate-jobs``: whole generate calls, HF's caches against mh.hf.patch + KVCacheAdapter."""
    from . import bench_generate

    if args.curve:
        return _bench_decode_curve(args)
    result = bench_generate.run_generate_jobs(
        models=args.gen_models, prompts=args.gen_prompts, batches=args.gen_batches, new_tokens=args.new_tokens,
        reps=args.reps, competing=args.competing, compiled=not args.no_compile, quick=args.quick,
        llama_bench=args.llama_bench, progress=_say)
    return _write_result(args, result, "generate_jobs.json", bench_generate.format_generate_jobs(result))


def _bench_decode_curve(args: argparse.Namespace) -> int:
    """``bench --generate-jobs --curve``: one row's decode rate against the prompt's length, and its picture."""
    from . import bench_decode_curve as curve

    if args.gen_models is not None and len(args.gen_models) > 1:
        raise ValueError("--curve takes one --model")
    result = curve.run_decode_curve(model=(args.gen_models or ["llama"])[0], lengths=args.gen_prompts,
                                    steps=args.reps, quick=args.quick, progress=_say)
    code = _write_result(args, result, "decode_curve.json", curve.format_decode_curve(result))
    try:
        print(f"wrote {curve.plot(result, Path(args.out) / 'decode_curve.png')}", file=sys.stderr)
    except ImportError:  # matplotlib is the optional [bench] extra
        pass
    return code


def _say(line: str) -> None:
    print(f"  running {line}", file=sys.stderr, flush=True)


def _write_result(args: argparse.Namespace, result: dict[str, Any], name: str, table: str) -> int:
    """Write ``result`` as ``args.out``/``name`` (JSON) and show ``table`` (or the JSON)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(result, indent=2), encoding="utf-8")
    _emit(args, result, table + f"\n\nwrote {path}")
    return 0


def _bench_embed(args: argparse.Namespace) -> int:
    """``bench --embed``: the embedding job against sentence-transformers."""
    from . import bench_embed

    result = bench_embed.run_embed(quick=args.quick, reps=args.reps, batch_sizes=args.embed_batch_sizes or (32,),
                                   texts=args.texts, peers_python=args.peers_python, peers_cache=args.peers_cache,
                                   competing=args.competing, progress=_say)
    return _write_result(args, result, "embed.json", bench_embed.format_embed(result))


def _bench_flex(args: argparse.Namespace) -> int:
    """``bench --flex``: mask_mods and score_mods against compiled FlexAttention and SDPA."""
    from . import bench_flex

    result = bench_flex.run_flex(quick=args.quick, progress=_say)
    return _write_result(args, result, "flex.json", bench_flex.format_flex(result))


def cmd_heads(args: argparse.Namespace) -> int:
    from ..heads.command import main as heads_main  # the heads toolkit, imported only when asked for

    return heads_main(args)


def cmd_embed(args: argparse.Namespace) -> int:
    """``multihead embed FILE``: :func:`~multihead.tools.embed.embed_file`, a progress bar on stderr."""
    from tqdm.auto import tqdm

    import torch

    from .embed import embed_file
    from .machine import busy_note

    bars: list[Any] = []  # the bar starts with the first batch: a refused file or model shows none

    def progress(done: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(total=total, desc="multihead embed", unit="text", disable=args.no_progress,
                             leave=False, file=sys.stderr))
        bars[0].update(done - bars[0].n)

    try:
        info = embed_file(args.file, args.out, model_dir=args.model, batch_size=args.batch_size,
                          threads=args.threads, dtype=getattr(torch, args.dtype), progress=progress)
    finally:
        for bar in bars:
            bar.close()
    cut = info["truncated"]
    if cut["count"]:  # said on stderr even with --json: a cut is never silent
        lines = ", ".join(map(str, cut["lines"][:10])) + (" ..." if cut["count"] > 10 else "")
        print(f"note: {cut['count']} of {info['texts']} lines were cut to the model's {info['max_length']} tokens "
              f"(as sentence-transformers cuts them): line {lines}", file=sys.stderr, flush=True)
    text = (f"wrote {info['out']}: {info['texts']} embeddings of {info['embed_dim']} float32 "
            f"({'unit vectors' if info['normalized'] else 'not normalised'}) of the lines of {info['input']}\n"
            f"model {info['model_dir']} (attention patched by multihead, the encoder in {info['dtype']}), "
            f"at most {info['max_length']} tokens a text\n"
            f"{info['batches']} batch{'es' if info['batches'] != 1 else ''} of up to {info['batch_size']} texts "
            "sorted by length, "
            f"{_threads_used(info)}, {info['seconds']:.2f} s")
    busy = busy_note(info["others_cpu_share"])
    if busy is not None:
        text += f"\n{busy}" + ("" if info["auto_threads"] else "; beside a busy process, --threads auto (or 1) "
                                                                "can be faster")
    _emit(args, info, text)
    return 0


def _threads_used(info: dict[str, Any]) -> str:
    """The threads ``embed_file`` ran on, in words: N, or with ``--threads auto`` each count's batches."""
    if not info["auto_threads"]:
        return f"{info['threads']} torch threads"
    counts = {n: info["batch_threads"].count(n) for n in sorted(set(info["batch_threads"]), reverse=True)}
    return "torch threads chosen per batch (auto): " + ", ".join(
        f"{n} on {k} batch{'es' if k != 1 else ''}" for n, k in counts.items())


def cmd_build(args: argparse.Namespace) -> int:
    """``multihead build``: the kernels' builds, the one this CPU runs, loaded as the library would
    (compiling the machine's own where none installed runs here); ``--machine`` compiles that one."""
    from ..backends import native
    from ..backends.native import cpu, isa

    info: dict[str, Any] = {"cpu": cpu.cpuinfo().get("model name", "unknown"), "builds": list(isa.names()),
                            "installed": list(isa.installed()), "runs_here": list(isa.runnable())}
    if args.machine:
        info["machine_build"], info["status"] = native.compile_for_machine()
    else:
        info["available"], info["status"] = native.build(), native.status()
        info["used"] = native.build_name()
    lines = [f"CPU: {info['cpu']}", f"builds installed: {', '.join(info['installed']) or 'none'} "
             f"(of {', '.join(info['builds'])})", f"this CPU runs: {', '.join(info['runs_here']) or 'none of them'}",
             f"status: {info['status']}"]
    _emit(args, info, "\n".join(lines))
    return 0 if info.get("available", info.get("machine_build")) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multihead",
        description="Multi-head attention exactly as it is taught: see each step, check it, cost it, run it.")
    parser.add_argument("--version", action="version", version=f"multihead {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("explain", help="the seed's section-7 table, observed while running a layer")
    p.add_argument("config", nargs="?", default=None, metavar="CONFIG|DIR",
                   help="a config.json or checkpoint folder (default: the seed's example)")
    p.add_argument("--seq", type=int, default=SEED_SEQ_LEN,
                   help=f"tokens S (default %(default)s; at most {max_seq_len(None)} for the seed's example, "
                        f"{max_seq_len('config')} for a config)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--html", default=None, metavar="PATH",
                   help="write the lesson as one offline page on real tensors: the bundled MiniLM's first layer on "
                        "--text (or CONFIG's layer 0, or --random), each step beside the float64 reference")
    p.add_argument("--text", default=None, help="with --html: the sentence (default: an example sentence)")
    p.add_argument("--model", default=None, metavar="DIR", help="with --html: a checkpoint folder instead of MiniLM")
    p.add_argument("--random", action="store_true",
                   help="with --html: random weights at the seed's sizes (d=768, h=12), one token per word")
    p.add_argument("--max-bytes", type=int, default=None,
                   help="with --html: refuse a larger page (default 2,000,000)")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("cost", help="parameters, FLOPs and KV-cache bytes of a config's attention")
    p.add_argument("config", metavar="CONFIG|DIR", help="a config.json or checkpoint folder")
    p.add_argument("--seq", type=int, default=SEED_SEQ_LEN, help="tokens S (default %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="sequences B (default %(default)s)")
    p.add_argument("--dtype", default="float32", help="K/V element type (default %(default)s)")
    p.add_argument("--per-layer", action="store_true", help="a row per layer (heads, window, FLOPs, cache)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_cost)

    p = sub.add_parser("run", help="run a real model (default: the bundled all-MiniLM-L6-v2) on multihead")
    p.add_argument("text", nargs="*", help="texts to embed (default: a few example sentences)")
    p.add_argument("--model", default=None, metavar="DIR", help="checkpoint folder (config.json + model.safetensors)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--competing", action="store_true",
                   help="time the layers beside one CPU-bound process (both sides under the same load)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("bench", help="benchmark multihead against torch and Hugging Face on this machine")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repetitions (a smoke test)")
    p.add_argument("--out", default="benchmarks/results", metavar="DIR",
                   help="where to write bench.json and bench.png (default %(default)s)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads (default: torch's, one per core)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    p.add_argument("--hf-generate", action="store_true",
                   help="instead of the suite: a transformers Llama's prefill and decoding step, unpatched vs "
                        "patched vs patched + mh.hf.KVCacheAdapter (minutes; --quick: seconds)")
    p.add_argument("--families", nargs="*", default=None, metavar="TYPE",
                   help="with --hf-generate: instead of the Llama, one decoding step of each model type named "
                        "(default: every family of multihead.tools.bench_hf_families.FAMILIES transformers has), "
                        "HF against patched + mh.hf.KVCacheAdapter, logits checked (a few minutes; --quick: seconds)")
    p.add_argument("--compiled", action="store_true",
                   help="with --hf-generate: also the decoding step compiled, HF's StaticCache against "
                        "mh.hf.KVCacheAdapter (each model's forward under torch.compile)")
    p.add_argument("--generate-jobs", action="store_true",
                   help="instead of the suite: whole model.generate calls of a 0.5B Llama and Qwen3 (random "
                        "weights), time to first token and decode tokens/s, HF's DynamicCache and StaticCache "
                        "(eager and compiled) against mh.hf.patch + KVCacheAdapter (eager and compiled), "
                        "tokens checked equal (the full matrix: hours on 2 cores; --quick: tiny sizes)")
    p.add_argument("--curve", action="store_true",
                   help="with --generate-jobs: instead of whole calls, the decode rate of one row against the "
                        "prompt's length (--prompt; default 256 512 1024 2048 4096), HF's DynamicCache and "
                        "StaticCache against patched + KVCacheAdapter, --reps timed steps each (default 16), "
                        "with decode_curve.png (a few minutes)")
    p.add_argument("--model", choices=("llama", "qwen3"), action="append", default=None, dest="gen_models",
                   help="with --generate-jobs: this model only (repeatable; default both; with --curve one, "
                        "default llama)")
    p.add_argument("--prompt", type=_positive_int, nargs="+", default=None, dest="gen_prompts", metavar="P",
                   help="with --generate-jobs: prompt lengths (default 512 2048)")
    p.add_argument("--batch", type=_positive_int, nargs="+", default=None, dest="gen_batches", metavar="B",
                   help="with --generate-jobs: batch sizes, rows left-padded to different lengths (default 1 8)")
    p.add_argument("--new-tokens", type=_positive_int, default=None, metavar="N",
                   help="with --generate-jobs: tokens generated per call, at least 2 (default 128)")
    p.add_argument("--reps", type=_positive_int, default=None,
                   help="with --generate-jobs: timed calls of each way per job, after two untimed (one with "
                        "--no-compile; default 3); with --embed: timed calls of each way per batch size, after "
                        "one untimed (default 7); with --families: timed steps of each way per family (default 15)")
    p.add_argument("--competing", action="store_true",
                   help="with --generate-jobs or --embed: one CPU-bound process runs beside the timings (ended "
                        "with them)")
    p.add_argument("--no-compile", action="store_true",
                   help="with --generate-jobs: without the two compiled ways (compiling takes minutes)")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="with --generate-jobs: llama.cpp's llama-bench (built from its source), timed on the same "
                        "model written as GGUF (float32, and Q8_0 with llama-quantize beside it) after each job "
                        "of one row; needs the gguf package")
    p.add_argument("--embed", action="store_true",
                   help="instead of the suite: the embedding job, a corpus of 512 texts through the bundled model, "
                        "against sentence-transformers (a minute; --quick: seconds)")
    p.add_argument("--texts", type=_positive_int, default=None, metavar="N",
                   help="with --embed: the corpus's size (default 512; --quick: 24)")
    p.add_argument("--batch-size", type=_positive_int, nargs="+", default=None, dest="embed_batch_sizes",
                   metavar="B", help="with --embed: batch sizes, one timed round-robin each (default 32)")
    p.add_argument("--peers-python", default=None, metavar="PATH",
                   help="with --embed: the Python of the peers' environment, to time sentence-transformers' "
                        "ONNX Runtime and OpenVINO backends too (docs: Performance, the peers' environment)")
    p.add_argument("--peers-cache", default=None, metavar="DIR",
                   help="with --peers-python: where the model exported to ONNX and OpenVINO is kept "
                        "(default ~/.cache/multihead/embed-peers)")
    p.add_argument("--flex", action="store_true",
                   help="instead of the suite: mask_mods and score_mods (causal, window, documents, prefix-LM, "
                        "sparse tiles, T5 bias, soft-capping) against compiled FlexAttention and SDPA, forward "
                        "and forward + backward (minutes: FlexAttention compiles each case)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("heads", help="what each head does: metrics and labels, a page, a picture, importance")
    p.add_argument("text", nargs="*", help="texts (default: a few example sentences)")
    p.add_argument("--model", default=None, metavar="DIR", help="checkpoint folder (default: the bundled MiniLM)")
    p.add_argument("--html", default=None, metavar="PATH", help="write the interactive page here")
    p.add_argument("--png", default=None, metavar="PATH", help="write the layers × heads picture here")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--importance", action="store_true", help="rank heads by ablation and report pruning")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: torch's)")
    p.set_defaults(func=cmd_heads)

    p = sub.add_parser("embed", help="sentence embeddings of a file's lines, equal to sentence-transformers' encode")
    p.add_argument("file", metavar="FILE", help="a UTF-8 text file, one text per line (no blank lines)")
    p.add_argument("--out", default=None, metavar="PATH.npy|PATH.jsonl",
                   help="where to write the (N, E) float32 rows (default: FILE with the suffix .npy)")
    p.add_argument("--batch-size", type=_positive_int, default=32,
                   help="texts per forward pass, sorted by length (default %(default)s)")
    p.add_argument("--threads", type=_threads_or_auto, default=None, metavar="N|auto",
                   help="torch threads (default: torch's); auto: torch's or one, batch by batch, whichever runs "
                        "faster now (one is often faster beside a busy process)")
    p.add_argument("--model", default=None, metavar="DIR", help="checkpoint folder (default: the bundled MiniLM)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the encoder's precision (default %(default)s: equal to sentence-transformers; bfloat16: "
                        "about twice as fast on CPUs with AMX or AVX512-BF16, cosine about 0.9999 to float32's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("build", help="which build of the native kernels runs here; --machine compiles this machine's")
    p.add_argument("--machine", action="store_true",
                   help="compile the kernels for this machine (-march=native) into the cache folder; used where "
                        "no installed build runs here, or with MULTIHEAD_NATIVE_ISA=machine")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_build)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``multihead`` command.

    A refused argument, config, checkpoint or text exits with status 2 and one line on
    stderr (``multihead: error: ...``), before any work where the check allows.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("seq", "batch"):
        if getattr(args, flag, 1) < 1:
            _refuse(parser, f"--{flag} must be a positive integer, got {getattr(args, flag)}")
    if args.command == "bench" and args.compiled and not args.hf_generate:
        _refuse(parser, "--compiled applies to --hf-generate only")
    if args.command == "bench" and args.families is not None and (not args.hf_generate or args.compiled):
        _refuse(parser, "--families applies to --hf-generate only, without --compiled")
    if args.command == "bench" and not args.generate_jobs:
        _refuse_generate_options(parser, args)
    if args.command == "bench" and args.curve:
        _refuse_curve_options(parser, args)
    if args.command == "bench" and not args.embed:
        _refuse_embed_options(parser, args)
    if args.command == "explain" and args.seq > max_seq_len(args.config):  # before any work
        what = "a config is explained (shapes only)" if args.config else "the seed's example runs (for real)"
        _refuse(parser, f"--seq must be at most {max_seq_len(args.config)} when {what}, got {args.seq}")
    try:
        return int(args.func(args))
    except (ValueError, TypeError, FileNotFoundError) as e:  # bad configs, checkpoints, texts
        _refuse(parser, str(e))
        return 2  # pragma: no cover (_refuse exits)


def _refuse_generate_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse ``bench``'s options that apply to ``--generate-jobs`` only, by name."""
    for flag, dest in (("--model", "gen_models"), ("--prompt", "gen_prompts"), ("--batch", "gen_batches"),
                       ("--new-tokens", "new_tokens"), ("--reps", "reps"), ("--competing", "competing"),
                       ("--no-compile", "no_compile"), ("--curve", "curve"), ("--llama-bench", "llama_bench")):
        if (dest == "reps" and (args.embed or args.families is not None)) or (dest == "competing" and args.embed):
            continue
        if getattr(args, dest) not in (None, False):
            _refuse(parser, f"{flag} applies to --generate-jobs only"
                    + (" (and to --embed and --families)" if dest == "reps" else
                       " (and to --embed)" if dest == "competing" else ""))


def _refuse_curve_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, by name, the ``--generate-jobs`` options a ``--curve`` run does not take."""
    for flag, dest in (("--batch", "gen_batches"), ("--new-tokens", "new_tokens"), ("--competing", "competing"),
                       ("--no-compile", "no_compile"), ("--llama-bench", "llama_bench")):
        if getattr(args, dest) not in (None, False):
            _refuse(parser, f"{flag} does not apply to --curve (one row, eager ways, --reps timed steps)")


def _refuse_embed_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse ``bench``'s options that apply to ``--embed`` only, by name."""
    for flag, dest in (("--texts", "texts"), ("--batch-size", "embed_batch_sizes"),
                       ("--peers-python", "peers_python"), ("--peers-cache", "peers_cache")):
        if getattr(args, dest) is not None:
            _refuse(parser, f"{flag} applies to --embed only")


def _refuse(parser: argparse.ArgumentParser, message: str) -> None:
    """Exit with status 2 and the message on one line of stderr (no usage, no traceback)."""
    parser.exit(2, f"{parser.prog}: error: {' '.join(message.split())}\n")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
