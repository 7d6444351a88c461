"""Builds the native kernels when the package is installed: one Python extension module per
vector width (``csrc/variants.json``), chosen at run time by the CPU's flags.

Each build is optional: where one cannot be compiled (no C++ compiler, a compiler too old for
AMX), the install goes on without it and says so; the package then runs its torch paths, or
compiles the kernels for the machine on first use (with a message), or with ``multihead build``.
The kernels depend on no torch C++ ABI (plain C entry points, tensors passed as addresses), so
one build serves every torch the package allows.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = Path("src/multihead/backends/native/csrc")
UNITS = ("module.cpp", "attention.cpp", "attention_amx.cpp", "decode.cpp", "backward.cpp")
FLAGS = ("-O3", "-fopenmp", "-std=c++17", "-g0")  # -g0: no debug info (Python's CFLAGS carry -g)


def variants() -> list[dict]:
    table = json.loads((CSRC / "variants.json").read_text())
    return table["x86_64" if platform.machine().lower() in ("x86_64", "amd64") else "other"]


class BuildKernels(build_ext):
    """Compiles each build into a folder of its own (they share source names), the builds in
    parallel (one per core)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def build_extension(self, ext: Extension) -> None:
        objects = self.compiler.compile(
            ext.sources, output_dir=os.path.join(self.build_temp, ext.name), include_dirs=ext.include_dirs,
            macros=ext.define_macros, extra_postargs=ext.extra_compile_args, depends=ext.depends)
        self.compiler.link_shared_object(
            objects, self.get_ext_fullpath(ext.name), extra_postargs=ext.extra_link_args, target_lang="c++")


def extension(variant: dict) -> Extension:
    name = f"_kernels_{variant['name']}"
    return Extension(
        f"multihead.backends.native.{name}", sources=[str(CSRC / unit) for unit in UNITS],
        depends=[str(p) for p in sorted(CSRC.glob("*.h"))], define_macros=[("MH_MODULE", name)],
        extra_compile_args=[*FLAGS, *variant["march"]], extra_link_args=["-fopenmp", "-lstdc++"],
        language="c++", optional=True)


setup(ext_modules=[extension(v) for v in variants()], cmdclass={"build_ext": BuildKernels})
