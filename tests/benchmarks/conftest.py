"""Shared by the benchmark-script tests: import a module of ``benchmarks/`` (they import each other by name)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench_module():
    def load(name: str):
        sys.path.insert(0, str(BENCHMARKS))
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(str(BENCHMARKS))

    return load


def nvrtc_bench(bench_module, name: str):
    """The benchmark module ``name`` that cross-compiles CUDA with NVRTC and disassembles with Triton's tools;
    skips where either is missing."""
    pytest.importorskip("triton", reason="the disassembler comes with triton (make test installs it)")
    mod = bench_module(name)
    if mod.nvrtc_library() is None:
        pytest.skip("needs NVRTC: pip install nvidia-cuda-nvrtc==13.0.* (make test installs it)")
    return mod
