"""Which build of the native kernels runs here.

The package is installed with one build of the kernels per vector width (``csrc/variants.json``,
compiled by ``setup.py``: ``amx``, ``avx512``, ``avx2`` and ``baseline`` on x86-64, ``generic``
elsewhere), each a Python extension module ``_kernels_<name>``. The first one in that order whose
CPU flags ``/proc/cpuinfo`` lists is used, so one install serves any x86-64 machine it lands on.
Where none is installed that can run here (the package was installed without a C++ compiler),
the kernels are compiled for this machine instead (``-march=native``: the ``machine`` build, on
first use with a message, or ahead with ``multihead build``; :mod:`._build`).

``MULTIHEAD_NATIVE_ISA`` names the build to use instead (one of :func:`names`, or ``machine``);
one this CPU cannot run, or one not installed, is refused by name (:class:`ValueError`) rather
than replaced by another. Read on first use of the kernels; nothing happens at import time.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import platform
from importlib import resources
from typing import NamedTuple

from .cpu import cpuinfo

__all__ = ["ENV", "MACHINE", "Build", "table", "names", "needs", "missing", "installed", "runnable", "chosen",
           "module_name"]

#: The environment variable that names the build to use.
ENV = "MULTIHEAD_NATIVE_ISA"
#: The build compiled on (and for) this machine, not installed with the package.
MACHINE = "machine"


class Build(NamedTuple):
    """One installed build: its name, its compiler flags, the CPU flags it adds to the next one's."""

    name: str
    march: tuple[str, ...]
    needs: tuple[str, ...]


@functools.cache
def table() -> tuple[Build, ...]:
    """The builds made at install for this architecture, best first (``csrc/variants.json``)."""
    data = json.loads(resources.files(__package__).joinpath("csrc", "variants.json").read_text())
    arch = "x86_64" if platform.machine().lower() in ("x86_64", "amd64") else "other"
    return tuple(Build(v["name"], tuple(v["march"]), tuple(v["needs"])) for v in data[arch])


def names() -> tuple[str, ...]:
    """The installed builds' names, best first."""
    return tuple(b.name for b in table())


def needs(name: str) -> frozenset[str]:
    """Every CPU flag the build ``name`` runs on: its own and those of the builds after it (each
    x86-64 build is a superset of the next)."""
    builds = names()
    if name not in builds:
        raise ValueError(f"{ENV}: no build named {name!r}; the builds are {', '.join(builds)} and {MACHINE!r}")
    return frozenset(flag for b in table()[builds.index(name):] for flag in b.needs)


def missing(name: str, flags: frozenset[str] | None = None) -> list[str]:
    """The CPU flags the build ``name`` needs that ``flags`` (default: this CPU's) lacks, sorted."""
    have = frozenset(cpuinfo().get("flags", "").split()) if flags is None else flags
    return sorted(needs(name) - have)


def module_name(name: str) -> str:
    return f"{__package__}._kernels_{name}"


def installed() -> tuple[str, ...]:
    """The builds installed with the package (whatever this CPU can run), best first."""
    return tuple(name for name in names() if importlib.util.find_spec(module_name(name)) is not None)


def runnable() -> tuple[str, ...]:
    """The installed builds this CPU can run, best first."""
    return tuple(name for name in installed() if not missing(name))


def chosen() -> str:
    """The build to load: ``$MULTIHEAD_NATIVE_ISA`` where set, else the best installed build this
    CPU runs, else :data:`MACHINE` (compiled here).

    Raises:
        ValueError: ``$MULTIHEAD_NATIVE_ISA`` names no build, one this CPU cannot run (naming the
            flags it lacks), or one that was not installed.
    """
    wanted = os.environ.get(ENV, "").strip()
    if not wanted:
        found = runnable()
        return found[0] if found else MACHINE
    if wanted == MACHINE:
        return MACHINE
    lacks = missing(wanted)
    if lacks:
        raise ValueError(f"{ENV}={wanted}: this CPU cannot run the {wanted} build (it lacks {', '.join(lacks)}); "
                         f"it runs: {', '.join(runnable()) or 'none of the installed builds'}")
    if wanted not in installed():
        raise ValueError(f"{ENV}={wanted}: the {wanted} build was not installed (it failed to compile at install); "
                         f"installed: {', '.join(installed()) or 'none'}; {MACHINE!r} compiles one here")
    return wanted
