"""Session 39 probe (GPU): the experts' GPU path with a batch of no tokens (an idle rank), dense and packed FP4
weights, with and without records; prints one JSON line per case."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from megatron_trace.config import TraceConfig  # noqa: E402
from megatron_trace.rollout.fp4_moe import grouped_experts_forward  # noqa: E402

cfg = TraceConfig()
E, H, F, k = 8, 128, 64, 2
dev = "cuda"
fc1 = torch.randn(E, 2 * F, H, device=dev, dtype=torch.bfloat16) * 0.05
fc2 = torch.randn(E, H, F, device=dev, dtype=torch.bfloat16) * 0.05
wq = cfg.weight_quantizer()
for T in (0, 3):
    for weights in ("dense", "fp4"):
        for record in (False, True):
            w1, w2 = (fc1, fc2) if weights == "dense" else (wq.quantize(fc1), wq.quantize(fc2))
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
            idx = torch.randint(0, E, (T, k), device=dev)
            wts = torch.rand(T, k, device=dev)
            try:
                out = grouped_experts_forward(x, idx, wts, w1, w2, activation_quantizer=cfg.activation_quantizer(),
                                              record_fc1=record, record_fc2=record)
                torch.cuda.synchronize()
                res = {"ok": True, "shape": list(out.out.shape)}
            except Exception as e:  # noqa: BLE001
                res = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps({"tokens": T, "weights": weights, "record": record, **res}), flush=True)
