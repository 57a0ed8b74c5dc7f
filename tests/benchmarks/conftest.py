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
