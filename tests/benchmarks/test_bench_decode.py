"""CPU smoke run of ``benchmarks/bench_decode.py --smoke`` (tiny model, reference paths) and its plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_emits_every_point_and_a_plot(tmp_path):
    out = tmp_path / "decode.jsonl"
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}", "TORCHDYNAMO_DISABLE": "1", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--smoke", "--profile", "--out", str(out),
           "--generate-batches", "2", "--gen-prompt", "8", "--gen-tokens", "3", "--gen-reps", "2",
           "--gen-gc", "manual", "--profile-generate"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["bench"] for r in rows[:1]] == ["decode_setup"] and rows[-1]["bench"] == "decode_summary"
    points = {(r["mode"], r["batch"], r["context"]) for r in rows if r["bench"] == "decode"}
    modes = ("bf16", "fp4f", "fp4", "fp4u")  # the default: the backend's fast FP4-KV attention first, then the exact
    assert points == {(m, b, c) for m in modes for b in (1, 2) for c in (16, 48)}
    for r in rows:
        if r["bench"] == "decode":
            assert r["eager_tok_s"] > 0 and r["kv_bytes"] > 0
            p = r["profile"]
            assert 0 < p["moe_share"] < 1 and 0 < p["attention_share"] < 1
            assert (p["kv_update_ms"] > 0) == (r["mode"] == "fp4" or p["kv_update_ms"] > 0)
    fp4 = {(r["batch"], r["context"]): r["kv_bytes"] for r in rows if r.get("mode") == "fp4" and "kv_bytes" in r}
    # the CPU backend reads FP4 KV by dequantizing (no fused attention: neither kernel), and every row says so
    assert all(r["fused_kv_attention"] is False and r["fast_kv_attention"] is False
               for r in rows if r["bench"] == "decode" or (r["bench"] == "decode_generate" and r["mode"] != "bf16"))
    bf16 = {(r["batch"], r["context"]): r["kv_bytes"] for r in rows if r.get("mode") == "bf16" and "kv_bytes" in r}
    # FP4 KV: 0.5 + 1/16 + 4/head_dim bytes per element vs 4 (fp32 on the CPU)
    assert all(fp4[k] * 4 < bf16[k] for k in fp4)
    gen = [r for r in rows if r["bench"] == "decode_generate"]
    assert {r["mode"] for r in gen} == set(modes) and all(r["tok_s"] > 0 for r in gen)
    assert all(("capture_share" in r) == (r["mode"] != "bf16") for r in gen)  # FP4 records guidance, BF16 not
    assert all(r["sec_no_capture"] > 0 for r in gen if r["mode"] != "bf16")
    for r in gen:  # two interleaved rounds each way; cProfile's hot list of the capture
        assert len(r["secs"]) == 2 and r["gc"] == "manual"
        if r["mode"] != "bf16":
            assert len(r["capture_shares"]) == len(r["secs_no_capture"]) == 2 and r["capture_hot"]
    ratios = rows[-1]["over_bf16"]
    assert len(ratios) == 12 and all(r["eager_x"] > 0 for r in ratios)
    png = tmp_path / "decode.png"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plot_decode.py"), str(out), str(png)], check=True,
                   timeout=60, env=env)
    assert png.stat().st_size > 1000


def test_budget_stops_adding_points(tmp_path):
    out = tmp_path / "decode.jsonl"
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}", "TORCHDYNAMO_DISABLE": "1", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--smoke", "--budget-s", "0.001",
           "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    measured = [r for r in rows if r["bench"] == "decode"]
    skipped = [r for r in rows if r["bench"] == "decode_skipped"]
    assert len(measured) <= 1 and len(measured) + len(skipped) == 16 and rows[-1]["bench"] == "decode_summary"


def test_profile_generate_smoke():
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}", "TORCHDYNAMO_DISABLE": "1", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "profile_generate.py"), "--smoke", "--batch", "2", "--tokens", "3",
           "--top", "5"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["mode"] for r in rows] == ["bf16", "fp4"]
    for r in rows:
        assert len(r["top_own_ms"]) == 5 and r["sec"] > 0
        assert r["top_cumulative_ms"][0][0].endswith("generate")  # the timed call itself holds the most


def test_left_padded_points_pass_a_mask_to_the_fused_attention(tmp_path):
    """``--left-pad``: the decode steps get an attention mask, and ``--masks`` is recorded (the fused attention that
    reads it is off on the CPU: tests/rollout/test_kv_cache.py runs the interval path)."""
    out = tmp_path / "decode.jsonl"
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}", "TORCHDYNAMO_DISABLE": "1", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--smoke", "--modes", "fp4f",
           "--batches", "3", "--lengths", "16", "--left-pad", "0.5", "--masks", "interval", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines() if '"decode"' in line]
    assert len(rows) == 1 and rows[0]["masks"] == "interval" and rows[0]["left_pad"] == 0.5
    assert rows[0]["eager_ms"] > 0


def test_every_mode_of_a_point_decodes_the_same_history_and_tokens(bench_module, monkeypatch):
    import torch

    bd = bench_module("bench_decode")
    seen = {}
    fill, eager = bd.fill_cache, bd.time_eager

    def fill_cache(be, cache, batch, length, gen):
        seen.setdefault((batch, length), []).append(gen.get_state().clone())
        return fill(be, cache, batch, length, gen)

    def time_eager(be, model, cache, tok, pos, *args, **kwargs):
        seen[(tok.shape[0], int(pos[0, 0]))].append(tok.clone())
        return eager(be, model, cache, tok, pos, *args, **kwargs)

    monkeypatch.setattr(bd, "fill_cache", fill_cache)
    monkeypatch.setattr(bd, "time_eager", time_eager)
    bd.main(["--smoke", "--modes", "bf16,fp4,fp4u", "--batches", "1,2", "--lengths", "16,48", "--no-graph"])
    assert set(seen) == {(b, c) for b in (1, 2) for c in (16, 48)}
    for point, got in seen.items():  # [state, tok] per mode
        states, toks = got[0::2], got[1::2]
        assert len(states) == len(toks) == 3, point
        assert all(torch.equal(s, states[0]) for s in states) and all(torch.equal(t, toks[0]) for t in toks), point
    assert not torch.equal(seen[(2, 16)][0], seen[(2, 48)][0])  # (points differ from each other)
