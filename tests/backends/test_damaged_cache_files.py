"""Damaged files in the cache folder are discarded and rebuilt, never fatal; and one GEMM
verdict per machine however many processes measure at once.

Each scenario runs in fresh processes pointed at a temporary cache folder
(``$MULTIHEAD_CACHE_DIR``), as a user's later processes would meet the damaged file:

* ``gemm-choice.json`` (:mod:`multihead.backends.gemm`): a layer's forward works and the
  file is replaced by a well-formed record holding the verdict the process uses;
* the machine build's record ``attention-*.json`` (:mod:`multihead.backends.native._build`):
  ``compile_for_machine`` works, says why it rebuilt, and the record is rewritten. The
  "compiler" is a stand-in (this Python) that links a tiny real extension module, so a
  rebuild costs nothing;
* the race: several processes ask for the GEMM choice at once with an empty cache folder;
  each one's measurement would give a different verdict, and waits until every process
  has asked (files as a barrier, no timing), so without a lock every process would keep
  its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from multihead.backends import gemm

needs_onednn = pytest.mark.skipif(gemm.onednn_gemm() is None, reason="this torch has no oneDNN GEMM")

DEEP = b"[" * 100_000 + b"]" * 100_000


def _strict_json(data: bytes) -> object:
    """JSON as the standard has it: no NaN/Infinity (which Python's json would write for inf)."""
    def refuse(name: str) -> None:
        raise ValueError(f"non-standard constant {name}")

    return json.loads(data, parse_constant=refuse)


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MULTIHEAD_GEMM"}  # tests/conftest.py sets it
    return {**env, "MULTIHEAD_CACHE_DIR": str(cache), **extra}


# ---- gemm-choice.json ------------------------------------------------------------------

GEMM_SCRIPT = r"""
import json, os, sys
from pathlib import Path
import torch
import multihead as mh
from multihead.backends import gemm

measure = gemm.gemm_measurement
gemm.gemm_measurement = lambda rounds=11: measure(rounds=1)  # a real measurement, shorter

# Each case folder as a new process would meet it: nothing remembered from the case before.
reports = {}
for case in sorted(Path(sys.argv[1]).iterdir()):
    os.environ["MULTIHEAD_CACHE_DIR"] = str(case)
    gemm._measured_choice.cache_clear()
    report = reports[case.name] = {"key": gemm._machine_key()}
    try:
        layer = mh.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True)
        with torch.no_grad():
            y = layer(torch.randn(2, 8, 32))
        report.update(outcome="ok", finite=bool(torch.isfinite(y).all()), choice=gemm.gemm_choice())
    except BaseException as err:
        report.update(outcome=type(err).__name__)
print(json.dumps(reports))
"""

OTHER_MACHINE = {"choice": "torch", "torch_over_onednn": 0.5, "onednn_ms": 2.0, "torch_ms": 1.0}
# name -> what the damaged gemm-choice.json holds (the machine's own key is filled in as KEY)
GEMM_DAMAGE: dict[str, bytes] = {
    "deep_nesting": DEEP,
    "deep_nesting_in_the_entry": b'{"KEY": ' + DEEP + b"}",
    "huge_number": b'{"KEY": {"choice": "torch", "torch_ms": 1e400}}',
    "huge_number_elsewhere": b'{"other machine": 1e400}',
    "a_list": b'["onednn", "torch"]',
    "entry_a_string": b'{"KEY": "torch"}',
    "choice_a_number": b'{"KEY": {"choice": 5}}',
    "truncated": b'{"KEY": {"choice": "onednn", "torch_over',
    "binary_garbage": bytes(range(256)) * 8,
    "empty": b"",
    "others_kept": json.dumps({"another machine": OTHER_MACHINE, "a damaged one": [1e300]}).encode(),
}


@pytest.fixture(scope="module")
def gemm_reports(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict], Path]:
    key = gemm._machine_key()
    base = tmp_path_factory.mktemp("gemm")
    for name, content in GEMM_DAMAGE.items():
        (base / name).mkdir(mode=0o700)
        record = base / name / "gemm-choice.json"
        record.write_bytes(content.replace(b"KEY", json.dumps(key)[1:-1].encode()))
        record.chmod(0o600)
    done = subprocess.run([sys.executable, "-c", GEMM_SCRIPT, str(base)], capture_output=True, text=True,
                          timeout=300, env=_env(base / "unused"))
    assert done.returncode == 0, f"the process died ({done.returncode}): {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1]), base


@needs_onednn
@pytest.mark.parametrize("name", list(GEMM_DAMAGE))
def test_a_damaged_gemm_record_is_measured_again_and_replaced(gemm_reports, name: str) -> None:
    reports, base = gemm_reports
    report, record = reports[name], base / name / "gemm-choice.json"
    assert report["outcome"] == "ok" and report["finite"], report
    kept = _strict_json(record.read_bytes())
    assert isinstance(kept, dict) and kept[report["key"]]["choice"] == report["choice"], kept
    assert all(isinstance(v, dict) and v.get("choice") in gemm.GEMM_CHOICES for v in kept.values()), kept
    assert record.stat().st_mode & 0o777 == 0o600


@needs_onednn
def test_a_well_formed_verdict_of_another_machine_is_kept(gemm_reports) -> None:
    reports, base = gemm_reports
    kept = _strict_json((base / "others_kept" / "gemm-choice.json").read_bytes())
    assert kept["another machine"] == OTHER_MACHINE and "a damaged one" not in kept
    assert kept[reports["others_kept"]["key"]]["choice"] == reports["others_kept"]["choice"]


# ---- the race: one verdict per machine --------------------------------------------------

RACE_SCRIPT = r"""
import json, os, sys, time
from pathlib import Path
from multihead.backends import gemm

barrier, index, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

def measured(rounds=11):
    # This process's own verdict, different from its neighbours': taken only once every process
    # has asked for the choice (so all of them are asking at the same time).
    (barrier / f"measuring-{index}").touch()
    deadline = time.monotonic() + 120
    while len(list(barrier.glob("asked-*"))) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"choice": "torch" if index % 2 else "onednn", "torch_over_onednn": None, "onednn_ms": None,
            "torch_ms": None, "process": index}

gemm.gemm_measurement = measured
(barrier / f"asked-{index}").touch()
print(json.dumps({"choice": gemm.gemm_choice(), "key": gemm._machine_key()}))
"""


@needs_onednn
def test_processes_measuring_at_once_all_keep_the_one_verdict_on_disk(tmp_path: Path) -> None:
    count = 3
    cache, barrier = tmp_path / "cache", tmp_path / "barrier"
    barrier.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", RACE_SCRIPT, str(barrier), str(i), str(count)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(cache))
             for i in range(count)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    kept = _strict_json((cache / "gemm-choice.json").read_bytes())
    on_disk = kept[reports[0]["key"]]["choice"]
    assert [r["choice"] for r in reports] == [on_disk] * count
    assert len(list(barrier.glob("measuring-*"))) == 1  # the others read the verdict back


# ---- the machine build's record ---------------------------------------------------------

TINY_MODULE = r"""
#include <Python.h>
static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, "_kernels_machine", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__kernels_machine(void) { return PyModule_Create(&tiny); }
"""

# A stand-in C++ compiler: unit compiles write an empty object; the link copies the tiny module.
STAND_IN = r"""
import shutil, sys
args = sys.argv[1:]
if "--version" in args:
    print("stand-in compiler 1.0")
    sys.exit(0)
tiny, out = args[0], args[args.index("-o") + 1]
if "-shared" in args:
    shutil.copyfile(tiny, out)
else:
    open(out, "wb").close()
"""

RECORD_SCRIPT = r"""
import json, os, shutil, sys
from pathlib import Path
from multihead.backends import native

base = Path(sys.argv[1])
cases = json.loads((base / "cases.json").read_text())
report = {}

def build(name):
    os.environ["MULTIHEAD_CACHE_DIR"] = str(base / name)
    try:
        ok, status = native.compile_for_machine()
        report[name] = {"outcome": "ok", "ok": ok, "status": status}
    except BaseException as err:
        report[name] = {"outcome": type(err).__name__}

build("good")
for name, content in cases.items():
    shutil.copytree(base / "good", base / name)
    record = next((base / name).glob("attention-*.json"))
    record.write_bytes(bytes.fromhex(content))
    build(name)
print(json.dumps(report))
"""

RECORD_DAMAGE: dict[str, bytes] = {
    "deep_nesting": DEEP,
    "deep_nesting_in_a_field": b'{"size": ' + DEEP + b', "sha256": "00"}',
    "huge_size": b'{"size": 1e400, "sha256": "SHA"}',
    "size_a_string": b'{"size": "SIZE", "sha256": "SHA"}',
    "size_a_bool": b'{"size": true, "sha256": "SHA"}',
    "size_negative": b'{"size": -1, "sha256": "SHA"}',
    "sha_a_number": b'{"size": SIZE, "sha256": 5}',
    "a_list": b"[SIZE, \"SHA\"]",
    "truncated": b'{"size": SIZE, "sha2',
    "binary_garbage": bytes(range(256)) * 8,
}


@pytest.fixture(scope="module")
def record_reports(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    base = tmp_path_factory.mktemp("records")
    include = sysconfig.get_paths()["include"]
    (base / "tiny.c").write_text(TINY_MODULE)
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None, "a C compiler builds the tiny stand-in module"
    tiny = base / f"tiny{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run([cc, "-shared", "-fPIC", f"-I{include}", "-o", str(tiny), str(base / "tiny.c")], check=True)
    (base / "stand_in.py").write_text(STAND_IN)
    data = tiny.read_bytes()
    size, sha = str(len(data)), hashlib.sha256(data).hexdigest()
    cases = {name: content.replace(b"SIZE", size.encode()).replace(b"SHA", sha.encode()).hex()
             for name, content in RECORD_DAMAGE.items()}
    cxx = f"{sys.executable} {base / 'stand_in.py'} {tiny}"
    env = _env(base / "unused", MULTIHEAD_NATIVE="1", MULTIHEAD_NATIVE_ISA="machine", CXX=cxx, TMPDIR=str(base))
    (base / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run([sys.executable, "-c", RECORD_SCRIPT, str(base)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, f"the process died ({done.returncode}): {done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1]), base


def test_the_stand_in_build_is_made_and_loaded(record_reports) -> None:
    report, _ = record_reports
    assert report["good"] == {"outcome": "ok", "ok": True, "status": report["good"]["status"]}
    assert report["good"]["status"].startswith("ready"), report["good"]


@pytest.mark.parametrize("name", list(RECORD_DAMAGE))
def test_a_damaged_build_record_is_rebuilt_and_replaced(record_reports, name: str) -> None:
    report, base = record_reports
    seen = report[name]
    assert seen["outcome"] == "ok" and seen["ok"], seen
    assert "rebuilt: the cached build was refused: its build record is unreadable" in seen["status"], seen
    kernel = next((base / name).glob("attention-*.so"))
    record = _strict_json(kernel.with_suffix(".json").read_bytes())
    data = kernel.read_bytes()
    assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
