"""The device scripts' summary of the CUDA GEMM benchmarks, on session 26's recorded results."""

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "s26"


def test_one_line_per_point_with_each_variant(bench_module):
    mod = bench_module("moe_mma_summary")
    path = RESULTS / "call8" / "moe_mma_final_mxfp4.json"
    out = mod.lines(str(path))
    points = json.loads(path.read_text())["results"]
    assert len(out) == 1 + len(points) and out[0] == "copy TB/s 4.253"
    assert out[1].startswith("qwen3_fc1 mxfp4 1 bf16 283.0 triton 95.8 ")
    assert "packed:default=69.8us/0.721/4.06x" in out[1]
    routing = mod.lines(str(RESULTS / "call5" / "moe_mma_routing_nvfp4.jsonl"))
    assert len(routing) == 14 and routing[2].startswith("qwen3_fc1 nvfp4 b 16 act 80 max 4 ")
