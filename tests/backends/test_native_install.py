"""The native kernels are compiled when the package is installed, one build per vector width,
and the one for this CPU is chosen at run time: the first call compiles nothing, importing the
library imports neither the compiler's driver nor ``torch.compile``'s machinery, a build the CPU
cannot run is refused by name, and the command line starts without torch.

Each scenario runs in a fresh subprocess (what a new user's first process does), with an empty
cache folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multihead import _compile
from multihead.backends import native
from multihead.backends.native import isa


def _python(code: str, tmp_path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("MULTIHEAD_NATIVE_ISA", "MULTIHEAD_NATIVE")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**environment, "MULTIHEAD_CACHE_DIR": str(tmp_path / "cache"), **env})


FIRST_CALL = r"""
import json, subprocess, sys, time
def no_compiler(*args, **kwargs):
    raise AssertionError(f"a program was run: {args[0]!r}")
subprocess.Popen = subprocess.run = no_compiler  # any compiler run fails the test
import torch
import multihead as mh
from multihead.backends import native
q, k, v = (torch.randn(1, 8, 300, 64) for _ in range(3))
start = time.perf_counter()
out = mh.attention(q, k, v, causal=True, backend="native")
first = time.perf_counter() - start
want = mh.attention(q.double(), k.double(), v.double(), causal=True, backend="explicit")
print(json.dumps({"build": native.build_name(), "status": native.status(), "first_s": first,
                  "err": (out.double() - want).abs().max().item(),
                  "modules": sorted(m for m in sys.modules
                                    if m.startswith(("torch._dynamo", "multihead.backends.native._build")))}))
"""


def test_the_first_call_runs_no_compiler_and_uses_the_installed_build(tmp_path) -> None:
    done = _python(FIRST_CALL, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["build"] in isa.runnable() and report["build"] == isa.runnable()[0], report
    assert report["status"].startswith(f"ready: the installed {report['build']} build"), report
    assert report["err"] < 1e-5
    assert report["modules"] == []  # neither the compiler's driver nor torch.compile's machinery
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("*.so"))  # nothing built
    assert "compiling" not in done.stderr


def test_importing_multihead_imports_neither_torch_compile_nor_the_build_module(tmp_path) -> None:
    code = ("import sys, multihead as mh, torch\n"
            "layer = mh.MultiHeadAttention(64, 4, causal=True, rope=mh.RoPE(16))\n"
            "layer(torch.randn(2, 9, 64)); mh.attention(*(torch.randn(1, 4, 40, 16),) * 3)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor',"
            " 'multihead.backends.native._build'))))")
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
    bare = _python("import sys, multihead; print(sorted(m for m in sys.modules if m.startswith('torch')))", tmp_path)
    assert bare.returncode == 0 and bare.stdout.strip() == "[]"  # `import multihead` alone imports no torch


def test_the_command_line_starts_without_torch(tmp_path) -> None:
    code = ("import sys\nfrom multihead.tools import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n"
            "    pass\nprint(sorted(m for m in sys.modules if m.startswith('torch')))")
    done = _python(code, tmp_path)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("[]"), done.stdout[-2000:] + done.stderr[-2000:]
    assert "{explain,cost,run,bench,heads,embed,build}" in done.stdout


def test_multihead_build_reports_the_build_this_cpu_uses(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "multihead", "build", "--json"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "MULTIHEAD_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["available"] and info["used"] == native.build_name() and info["runs_here"] == list(isa.runnable())
    assert set(info["installed"]) <= set(info["builds"]) and info["used"] in info["installed"]


def test_a_build_the_cpu_lacks_is_refused_naming_the_missing_flags(tmp_path) -> None:
    lacking = [name for name in isa.names() if isa.missing(name)]
    name = lacking[0] if lacking else "avx1024"  # an AMX machine runs every x86-64 build
    code = ("import torch, multihead as mh\ntry:\n"
            "    mh.attention(*(torch.randn(1, 2, 40, 16),) * 3, backend='native')\n"
            "except ValueError as err:\n    print('refused:', err)")
    done = _python(code, tmp_path, MULTIHEAD_NATIVE_ISA=name)
    assert done.returncode == 0, done.stderr[-2000:]
    if lacking:
        assert f"refused: MULTIHEAD_NATIVE_ISA={name}: this CPU cannot run the {name} build (it lacks " \
               f"{', '.join(isa.missing(name))})" in done.stdout, done.stdout
    else:
        assert "refused: MULTIHEAD_NATIVE_ISA: no build named 'avx1024'" in done.stdout, done.stdout


@pytest.mark.parametrize("name, flags, lacks", [
    ("avx512", {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "sse4_2", "ssse3", "popcnt"},
     ["avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl"]),
    ("avx2", {"sse4_2", "ssse3", "popcnt", "avx"}, ["abm", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe"]),
    ("baseline", {"sse4_2", "ssse3", "popcnt"}, []),
    ("amx", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx", "avx2", "fma", "f16c", "bmi1",
             "bmi2", "abm", "movbe", "sse4_2", "ssse3", "popcnt"}, ["amx_bf16", "amx_tile", "avx512_bf16"]),
])
def test_each_build_needs_its_flags_and_those_of_every_narrower_build(name: str, flags: set[str],
                                                                     lacks: list[str]) -> None:
    if name not in isa.names():  # not an x86-64 machine: its one build is "generic"
        assert isa.names() == ("generic",) and isa.missing("generic", frozenset()) == []
        return
    assert isa.missing(name, frozenset(flags)) == lacks


def test_the_builds_are_tried_best_first() -> None:
    names = isa.names()
    assert names in (("amx", "avx512", "avx2", "baseline"), ("generic",))
    wider = [isa.needs(n) for n in names]
    assert all(a > b for a, b in zip(wider, wider[1:]))  # each needs strictly more than the next


def test_marking_a_function_constant_matches_torch_compiles_own_decorator() -> None:
    """``constant_in_graphs`` sets what ``torch.compiler.assume_constant_result`` sets (checked
    on the installed torch, so an upgrade that changes it fails here, not in users' graphs)."""
    def theirs() -> int:
        return 1

    def ours() -> int:
        return 1

    torch.compiler.assume_constant_result(theirs)
    _compile.constant_in_graphs(ours)
    assert vars(theirs) == vars(ours) == {_compile.MARK: True}


def test_an_install_without_a_compiler_goes_on_without_the_kernels(tmp_path) -> None:
    """Each build is optional: where none compiles (here the compiler, linker and C++ compiler
    are all ``false``), the package's build succeeds, names each build that failed, and makes
    no kernel file; such an install then gets the machine's own build or the torch paths
    (``test_without_a_compiler_everything_still_works`` in test_native.py)."""
    import setuptools  # noqa: F401  (what the install builds with)

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-temp", str(tmp_path / "temp"),
                           "--build-lib", str(tmp_path / "lib")], cwd=root, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CC": "false", "CXX": "false", "LDSHARED": "false"})
    assert done.returncode == 0, done.stderr[-3000:]
    for name in isa.names():
        assert f'building extension "multihead.backends.native._kernels_{name}" failed' in done.stderr
    assert not list(tmp_path.rglob("*.so"))
