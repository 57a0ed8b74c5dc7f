"""Torch ops of one training step, plain FP4 QAT vs TRACE guided, by the megatron_trace source line that ran them.

On the GPU every op costs host time (~5-10 us to dispatch and launch), and a guided step is host-bound where its
layers are small, so the ops the guided path adds are its host cost in units that do not depend on the machine.
Tiny CPU model (4 layers, the deepest half guided, reference kernels: the quantizer's own ops under ``formats/``
are left out, they are the same in both arms). Prints one JSON line:
    python benchmarks/count_step_ops.py [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks._megatron import gpt, init_world, lm_batch, moe_config, stock_spec  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_trace")
SHAPE = dict(layers=4, hidden=64, experts=4, topk=2, moe_ffn=64, seq=64, batch=2, heads=4, groups=2, vocab=128)


class OpCounter(TorchDispatchMode):
    """Counts every aten op by the innermost megatron_trace frame on the stack ("other": none)."""

    def __init__(self):
        super().__init__()
        self.by_line: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [f for f in traceback.extract_stack() if f.filename.startswith(ROOT)]
        f = frames[-1] if frames else None
        self.by_line[f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {f.name}" if f else "other"] += 1
        return func(*args, **(kwargs or {}))


def count(fn) -> collections.Counter:
    fn()
    fn()
    with OpCounter() as c:
        fn()
    return c.by_line


def main(argv=None) -> dict:
    import bench_qat_step as b

    from megatron_trace.config import TraceConfig
    from megatron_trace.megatron import trace_spec

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    a = argparse.Namespace(**SHAPE)
    init_world("cpu")
    cfg, data = moe_config(a, "cpu"), lm_batch(a, "cpu")
    arms = {"fp4_qat": (TraceConfig(kernel="reference"), False),
            "trace_guided": (TraceConfig(kernel="reference", guided_layers="fraction", guided_fraction=0.5,
                                         cache_mode="compact"), True)}
    out = {"bench": "count_step_ops", "shape": SHAPE}
    for name, (tc, guided) in arms.items():
        model = gpt(cfg, trace_spec(stock_spec(cfg), tc), a, "cpu")
        sg = b.guidance_for(model, tc, cfg, a, "cpu", data)[0] if guided else None
        by_line = count(b.train_step_fn(model, data, sg, trace=True))
        ours = {k: v for k, v in by_line.items() if k != "other" and not k.startswith("formats")}
        out[name] = {"total_ops": sum(by_line.values()), "project_ops_outside_formats": sum(ours.values()),
                     "top": collections.Counter(ours).most_common(args.top)}
    out["guided_minus_qat_ops"] = out["trace_guided"]["total_ops"] - out["fp4_qat"]["total_ops"]
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
