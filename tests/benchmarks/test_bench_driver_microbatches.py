"""``benchmarks/bench_driver_microbatches.py``'s printed command."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def test_the_printed_command_names_the_interpreter_and_quotes_its_arguments(bench_module, monkeypatch):
    mod = bench_module("bench_driver_microbatches")
    argv = ["benchmarks/bench_driver_microbatches.py", "--config", "gpu", "--mbs", "256,64", "--arms", "a b"]
    monkeypatch.setattr(sys, "argv", argv)
    assert shlex.split(mod._command()) == [Path(sys.executable).name, *argv]
