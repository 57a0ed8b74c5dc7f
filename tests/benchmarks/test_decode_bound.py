"""``decode_bound.py`` and ``plot_step_breakdown.py`` on ``bench_decode.py --profile`` rows: the bound against an
independent computation, and inputs that hold nothing to bound or plot refused by name (they printed nothing, or an
empty figure, and exited 0)."""

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "s12" / "decode_final.jsonl"
DIMS = dict(head_dim=64, num_key_value_heads=2, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
            hidden_size=32, moe_intermediate_size=16)


def _row(mode: str, step_ms: float, kernels: list) -> dict:
    return {"bench": "decode", "mode": mode, "batch": 4, "context": 2048,
            "profile": {"step_ms": step_ms, "top_kernels": kernels, "kernels_per_step": 9}}


def _write(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "decode.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_bound_matches_an_independent_computation(bench_module):
    mod = bench_module("decode_bound")
    rows = [{"bench": "decode_setup", "model": DIMS}, _row("bf16", 3.0, [["nvjet_x", 1.0]]),
            _row("fp4f", 2.0, [["fp4_gemm_kernel", 0.5], ["fp4kv_decode_attn", 0.25], ["nvjet_x", 0.5]])]
    (out,) = mod.bounds(rows, copy_tb_s=2.0, fraction=0.5, fp4_mode="fp4f")
    experts = 8 * (1 - (1 - 2 / 8) ** 4)  # distinct experts of 4 tokens choosing top-2 of 8
    weights = experts * 3 * 32 * 16 * 3 * 4.5 / 8
    kv = 2 * (4 * 2 * 2048 * 3) * (64 / 2 + 64 / 16 + 4)
    bw = 2.0e12 * 0.5
    bound = (2.0 - 0.5 - 0.25) + weights / bw * 1e3 + kv / bw * 1e3
    assert out["bound_fp4_ms"] == round(bound, 4) and out["bound_x"] == round(3.0 / bound, 3)
    assert out["measured_x"] == 1.5 and out["experts_read"] == round(experts * 3, 1)


def test_decode_bound_refuses_a_file_with_nothing_to_bound(bench_module, tmp_path, capsys):
    mod = bench_module("decode_bound")
    with pytest.raises(SystemExit):  # no fp4 rows at all: printed nothing and exited 0
        mod.main([str(RESULTS), "--fp4-mode", "fp4"])
    err = capsys.readouterr().err
    assert "'fp4'" in err and "('fp4f', 8, 8192)" in err
    with pytest.raises(SystemExit):  # no decode_setup row: StopIteration
        mod.main([_write(tmp_path, [_row("bf16", 3.0, [])])])
    assert "no decode_setup row" in capsys.readouterr().err
    assert len(mod.main([str(RESULTS)])) == 4  # the recorded run: batch 8, 64 x context 8K, 32K


def test_breakdown_bars_split_each_step(bench_module, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    mod = bench_module("plot_step_breakdown")
    path = _write(tmp_path, [_row("fp4f", 2.0, [["fp4_gemm_kernel", 0.5], ["fp4kv_decode_attn", 0.25]])])
    mod.main([str(tmp_path / "out.png"), f"run={path}"])
    out = json.loads(capsys.readouterr().out)
    assert out["bars"] == [["run fp4f b4 2K", 2.0]] and (tmp_path / "out.png").exists()
    assert mod.split(_row("x", 2.0, [["fp4_gemm_kernel", 0.5], ["pair_kernel", 0.1]]))["small kernels"] == 1.4


@pytest.mark.parametrize("specs", [[], ["{path}"], ["empty={empty}"], ["run={path}", "empty={empty}"]])
def test_breakdown_refuses_specs_with_nothing_to_plot(bench_module, tmp_path, capsys, specs):
    """No spec, a spec without a label, a file without profiled decode rows: an empty figure (or a ValueError of
    unpacking) before; now refused, naming the spec."""
    mod = bench_module("plot_step_breakdown")
    path = _write(tmp_path, [_row("fp4f", 2.0, [["fp4_gemm_kernel", 0.5]])])
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"bench": "decode", "mode": "bf16", "batch": 1, "context": 1024}) + "\n")
    args = [s.format(path=path, empty=empty) for s in specs]
    with pytest.raises(SystemExit) as exc:
        mod.main([str(tmp_path / "out.png"), *args])
    assert exc.value.code == 2 and not (tmp_path / "out.png").exists()
    if args:
        assert args[-1] in capsys.readouterr().err
