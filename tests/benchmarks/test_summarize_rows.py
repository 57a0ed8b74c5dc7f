"""``benchmarks/summarize_rows.py wgmma``: one line per shape, format and tokens per expert of a
``bench_moe_wgmma.py`` output (session 28, call 6's MXFP4 run), each kernel's time, speedup and error; other benches'
rows give nothing."""

from __future__ import annotations

import json

import pytest

from .conftest import BENCHMARKS


def test_wgmma_rows(bench_module, capsys):
    mod = bench_module("summarize_rows")
    path = BENCHMARKS / "results" / "s28" / "call6" / "bench_mxfp4.json"
    mod.main(["wgmma", str(path)])
    lines = capsys.readouterr().out.splitlines()
    rows = json.loads(path.read_text())["results"]
    assert len(lines) == len(rows) == 4
    assert lines[0].startswith("qwen3_fc1 mxfp4 128 bf16 264.2 {'triton': (307.7, 0.859, None), 'wgmma128:default': "
                               "(211.5, 1.249, 1.06e-07)")
    assert mod.wgmma({"bench": "decode"}) is None


def test_unknown_kind_or_missing_file_refused_by_name(bench_module, capsys):
    """``skw FILE`` raised a KeyError and ``--help`` a ValueError of unpacking; refused naming the kinds now."""
    mod = bench_module("summarize_rows")
    for argv in (["skw", "x.jsonl"], ["decode"]):
        with pytest.raises(SystemExit) as exc:
            mod.main(argv)
        assert exc.value.code == 2
    assert "choose from 'attn', 'fast', 'decode', 'skew', 'wgmma'" in capsys.readouterr().err
