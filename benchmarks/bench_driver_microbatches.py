"""The RL driver's trainer pass (``GRPORun.train_pass``: Megatron's schedule, one ``trace_guidance`` context) at
several micro-batch sizes, on one batch of the main job's config, and where a pass's host time goes.

    python benchmarks/bench_driver_microbatches.py --config gpu --device cuda --arms bf16,trace --mbs 256,64,32
    python benchmarks/bench_driver_microbatches.py --config demo --device cpu --mbs 128,64,32    # the CPU demo's

Per arm and micro-batch size: the pass's wall time (median of --reps, CUDA synchronized), then a least-squares
fit wall = fixed + per_micro_batch * n, and cProfile's top functions (own time) of one pass at the smallest size.
``--count-ops``: also the operators one pass dispatches (each a kernel launch on the GPU, so a device-independent
measure of a host-bound pass), at each size, by the innermost module class that ran them ("backward" for the
autograd engine's, "driver" outside every module), and the same fit per operator.
Prints one JSON line per arm.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def _config(name: str, sft_steps: int):
    from hydra import compose, initialize_config_dir

    from megatron_trace.config import from_hydra, register_hydra
    from megatron_trace.rl.driver import RLConfig
    from megatron_trace.rl.sft import SFTConfig, TinyMoEConfig

    register_hydra()
    with initialize_config_dir(config_dir=str(ROOT / "examples" / "conf"), version_base=None):
        cfg = compose(name)
    sft = dict(cfg.sft, steps=sft_steps)
    rl = dict(cfg.rl, sentinel_prompts=0, micro_batch_size=0)
    return cfg.task, from_hydra(cfg.trace), TinyMoEConfig(**cfg.model), SFTConfig(**sft), RLConfig(**rl)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _pass(r, batch, adv, mbs: int) -> float:
    steps, _, _ = r._guidance(10_000 + mbs, batch, batch.guidance, mbs)
    _sync(batch.tokens.device.type)
    t = time.perf_counter()
    r.train_pass(batch, adv, steps)
    _sync(batch.tokens.device.type)
    dt = time.perf_counter() - t
    r.cache.drop(10_000 + mbs)
    return dt


class _OpCounter(TorchDispatchMode):
    """Counts dispatched operators by the innermost running module's class (global forward hooks)."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch._C._current_graph_task_id() != -1:
            where = "backward"
        else:
            where = self.stack[-1] if self.stack else "driver"
        self.counts[where] = self.counts.get(where, 0) + 1
        return func(*args, **(kwargs or {}))


def _count_ops(r, batch, adv, mbs: int) -> dict[str, int]:
    counter = _OpCounter()

    def enter(module, _args) -> None:
        counter.stack.append(type(module).__name__)

    def leave(_module, _args, _out) -> None:  # (returns None: the output stays the module's)
        counter.stack.pop()

    pre = torch.nn.modules.module.register_module_forward_pre_hook(enter)
    post = torch.nn.modules.module.register_module_forward_hook(leave)
    try:
        with counter:
            _pass(r, batch, adv, mbs)
    finally:
        pre.remove()
        post.remove()
    return dict(sorted(counter.counts.items(), key=lambda kv: -kv[1]))


def _fit(n: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares (fixed, per unit) of y = fixed + per * n."""
    mn, my = statistics.fmean(n), statistics.fmean(y)
    var = sum((x - mn) ** 2 for x in n)
    slope = sum((x - mn) * (v - my) for x, v in zip(n, y)) / var if var else float("nan")
    return my - slope * mn, slope


def _profile(r, batch, adv, mbs: int, top: int) -> list:
    prof = cProfile.Profile()
    prof.enable()
    _pass(r, batch, adv, mbs)
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]  # (file, line, func) -> (cc, nc, tt, ct, ...)
    return [{"func": f"{Path(k[0]).name}:{k[1]}:{k[2]}", "calls": v[1], "own_s": round(v[2], 4),
             "cum_s": round(v[3], 4)} for k, v in rows]


def _command() -> str:
    """The command line that ran this script, interpreter included (the script has no shebang: its path alone is not
    a command)."""
    return shlex.join([Path(sys.executable).name, *sys.argv])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gpu", help="examples/conf config name (demo | gpu)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--arms", default="bf16,trace")
    p.add_argument("--mbs", default=None, help="micro-batch sizes (rows), each dividing the batch (default: the "
                   "batch's rows, a quarter and an eighth of them)")
    p.add_argument("--sft-steps", type=int, default=100)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--count-ops", action="store_true", help="count the dispatched operators per pass and module")
    a = p.parse_args()

    from megatron_trace.rl.arms import make_arm
    from megatron_trace.rl.demo import init_distributed
    from megatron_trace.rl.driver import GRPORun
    from megatron_trace.rl.sft import sft_checkpoint
    from megatron_trace.rl.tasks import get_task

    task_name, trace, model, sft, rl = _config(a.config, a.sft_steps)
    rows = rl.prompts_per_step * rl.group_size
    sizes = [int(x) for x in a.mbs.split(",")] if a.mbs else [rows, rows // 4, rows // 8]
    bad = [m for m in sizes if m < 1 or rows % m]
    if bad:
        raise SystemExit(f"--mbs {bad}: each must divide the batch's {rows} rows ({a.config} config)")
    with tempfile.TemporaryDirectory() as tmp:
        task = get_task(task_name)
        ckpt = str(sft_checkpoint(Path(tmp) / "sft", task, model, sft, device=a.device))
        init_distributed(a.device)
        for name in a.arms.split(","):
            r = GRPORun(make_arm(name, trace), rl, task, ckpt, out_dir=Path(tmp) / name,
                        cache_dir=Path(tmp) / name / "c", device=a.device)
            _, ids = r._prompts(0)
            batch = r.rollout.generate(ids, r._sampling(0, rl.temperature))
            adv = torch.linspace(-1, 1, batch.tokens.shape[0], device=batch.tokens.device)
            for mbs in sizes:  # warm-up (the first pass of each shape)
                _pass(r, batch, adv, mbs)
            wall = {mbs: statistics.median(_pass(r, batch, adv, mbs) for _ in range(a.reps)) for mbs in sizes}
            n = [batch.tokens.shape[0] // m for m in sizes]
            fixed, slope = _fit(n, [wall[m] for m in sizes])
            ops = {}
            if a.count_ops:
                per = {m: _count_ops(r, batch, adv, m) for m in sizes}
                total = [sum(per[m].values()) for m in sizes]
                where = {k: _fit(n, [per[m].get(k, 0) for m in sizes])[1] for k in per[min(sizes)]}
                ops = {"ops": {"total": dict(zip(map(str, sizes), total)),
                               "fit": dict(zip(("fixed", "per_micro_batch"), map(round, _fit(n, total)))),
                               "per_micro_batch_by_module": {k: round(v) for k, v in where.items() if round(v)}}}
            print(json.dumps({
                "bench": "driver_microbatches", "config": a.config, "device": a.device, "arm": name,
                "rows": batch.tokens.shape[0], "seq": batch.tokens.shape[1],
                "wall_s": {str(m): round(wall[m], 4) for m in sizes},
                "fit": {"fixed_s": round(fixed, 4), "per_micro_batch_s": round(slope, 4)}, **ops,
                "profile_mbs": min(sizes), "top_own_time": _profile(r, batch, adv, min(sizes), a.top),
                "command": _command()}), flush=True)


if __name__ == "__main__":
    main()
