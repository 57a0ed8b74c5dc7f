"""The embedded CPU demo (``make demo``): SFT warm-up, then a short GRPO run of every arm, then the report.

Everything a run writes goes to ``output_dir``: metrics.jsonl, summary.md, PNG plots, TensorBoard
events (tb/), demo.log, per-arm checkpoints.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..config import TraceConfig
from . import report
from .arms import make_arm
from .driver import GRPORun, RLConfig
from .sft import SFTConfig, TinyMoEConfig, sft_checkpoint
from .tasks import get_task

logger = logging.getLogger(__name__)


def init_distributed(device: str) -> None:
    """World size 1: gloo + Megatron's parallel state on CPU (with the CPU shims), NCCL on CUDA."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    if device == "cpu":
        from ..testing.megatron_cpu import apply_cpu_shims, init_megatron

        apply_cpu_shims()
        init_megatron(0, 1)
        return
    import os

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ..testing.megatron_cpu import fix_router_without_te

    fix_router_without_te()

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)  # mbridge scatters CPU tensors
    torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)


def run(*, out_dir: Path, task_name: str, arms: list[str], trace: TraceConfig, rl: RLConfig, model: TinyMoEConfig,
        sft: SFTConfig, init_from: str | None = None, sft_cache: Path | None = None, device: str = "cpu",
        resume: bool = False, progress: bool = True) -> dict:
    """Run every arm with the same seed and prompts; returns the per-arm metrics rows."""
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    task = get_task(task_name)
    t0 = time.perf_counter()
    if init_from:
        hf_dir = str(init_from)
    else:
        bar = tqdm(total=sft.steps, desc="SFT warm-up", disable=not progress)
        hf_dir = str(sft_checkpoint(sft_cache or out_dir / "sft", task, model, sft, device=device,
                                    progress=lambda s, loss: (bar.update(1), bar.set_postfix(loss=f"{loss:.3f}"))))
        bar.close()
    if not arms:  # `arms=[]`: prepare the warm-up checkpoint only (e.g. before launching arms as separate jobs)
        logger.info("SFT checkpoint ready in %s; no arms to run", hf_dir)
        return {}
    init_distributed(device)
    writer = report.MetricsWriter(out_dir)
    if not resume and writer.path.exists():
        writer.path.unlink()
    for name in arms:
        arm = make_arm(name, trace)
        RouterReplay.clear_global_router_replay_instances()
        run_ = GRPORun(arm, rl, task, hf_dir, out_dir=out_dir / name, cache_dir=out_dir / "cache" / name, device=device)
        ckpt = out_dir / name / "ckpt.pt"
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        if resume and ckpt.exists():
            run_.load(ckpt)
        start_acc = run_.evaluate() if run_.state.step == 0 else None
        for _ in tqdm(range(run_.state.step, rl.steps), desc=f"RL {name:<10}", disable=not progress):
            m = run_.step()
            if start_acc is not None:
                m["eval/accuracy_start"], start_acc = start_acc, None
            if run_.state.step == rl.steps:
                m["eval/accuracy"] = run_.evaluate()
            writer.write(name, run_.state.step - 1, m)
            if rl.checkpoint_every and run_.state.step % rl.checkpoint_every == 0:
                run_.save(ckpt)
    writer.close()
    by_arm = report.load(writer.path)
    table = report.markdown_table(report.summary_rows(by_arm))
    try:
        plots = report.plot(by_arm, out_dir)
    except ImportError:  # matplotlib is in the examples extra
        logger.warning("matplotlib is not installed: no plots (pip install 'megatron_trace[examples]')")
        plots = []
    (out_dir / "summary.md").write_text(
        f"# TRACE demo: {task_name}, {len(arms)} arms, {rl.steps} RL steps\n\n{table}\n\n"
        + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n"
    )
    logger.info("demo finished in %.1f s; outputs in %s", time.perf_counter() - t0, out_dir)
    return by_arm
