"""The embedded CPU demo (``make demo``): SFT warm-up, then a short GRPO run of every arm, then the report.

Everything a run writes goes to ``output_dir``: run.json (settings with the seeds, package versions, git
commit), metrics.jsonl, summary.md, PNG plots, TensorBoard events (tb/), the log (hydra/rl_demo.log, from the
Hydra entry point), per-arm checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch

from ..config import TraceConfig
from . import report
from .arms import make_arm
from .driver import GRPORun, RLConfig
from .sft import SFTConfig, TinyMoEConfig, sft_checkpoint, sft_reusable
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
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    if device not in DEVICES:
        raise ValueError(f"device={device!r} must be one of {DEVICES}")
    flags = {"resume": resume, "progress": progress}  # (a Hydra override resume=no is the string 'no': truthy)
    bad = {k: v for k, v in flags.items() if not isinstance(v, bool)}
    if bad:
        raise ValueError(f"{bad} must be bools (true / false)")
    if isinstance(arms, str) or len(set(arms)) < len(arms):  # (an arm given twice ran once, the summary counted two)
        raise ValueError(f"arms={arms!r} must be a list of distinct arm names")
    arm_specs = {name: make_arm(name, trace) for name in arms}  # every arm name checked before any work
    if init_from:  # (before the arms are checked against ``model``: it must be the checkpoint's model)
        check_init_from(init_from, model)
    check_arms_fit_model(arm_specs, model)
    task = get_task(task_name)
    if resume:
        check_resume_steps(out_dir, arms, rl.steps)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_run_record(out_dir, task=task_name, arms=list(arms), trace=trace.to_dict(), rl=dataclasses.asdict(rl),
                     model=dataclasses.asdict(model), sft=dataclasses.asdict(sft), init_from=init_from, device=device,
                     resume=resume)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.perf_counter()
    if init_from:
        hf_dir = str(init_from)
    else:
        sft_dir = sft_cache or out_dir / "sft"
        # (a reused checkpoint trains nothing: no bar standing at 0/steps)
        reused = sft_reusable(sft_dir, task, model, sft, device)
        bar = tqdm(total=sft.steps, desc="SFT warm-up", disable=not progress or reused)
        hf_dir = str(sft_checkpoint(sft_dir, task, model, sft, device=device,
                                    progress=lambda s, loss: (bar.update(1), bar.set_postfix(loss=f"{loss:.3f}"))))
        bar.close()
    if not arms:  # `arms=[]`: prepare the warm-up checkpoint only (e.g. before launching arms as separate jobs)
        logger.info("SFT checkpoint ready in %s; no arms to run", hf_dir)
        return {}
    init_distributed(device)
    writer = report.MetricsWriter(out_dir, fresh=not resume)
    try:
        for name, arm in arm_specs.items():
            _run_arm(name, arm, rl, task, hf_dir, out_dir, writer, device=device, resume=resume, progress=progress)
    except BaseException:  # e.g. the mismatch gate: summarize the rows so far, then fail
        writer.close()
        if writer.path.exists():
            try:
                _summarize(writer.path, out_dir, task_name, len(arms), rl.steps)
            except Exception:
                logger.exception("no summary of the rows so far")
        raise
    writer.close()
    by_arm = _summarize(writer.path, out_dir, task_name, len(arms), rl.steps)
    logger.info("demo finished in %.1f s; outputs in %s", time.perf_counter() - t0, out_dir)
    return by_arm


DEVICES = ("cpu", "cuda")


def check_arms_fit_model(arm_specs: dict, model: TinyMoEConfig) -> None:
    """Each arm's TraceConfig against the demo model, before any work, as the arm's rollout and trainer check it once
    built (they did: after the SFT warm-up and every arm before it ran): ``exclude_modules`` patterns (every arm's
    rollout audits them) and a guided arm's layer policy (layers within the model; ``budget`` needs a measured
    profile, which the demo does not have)."""
    from ..guidance.selection import guided_layers
    from ..manifest import check_guided_layers, excluded_modules

    layers = range(model.num_layers)  # (every layer of the demo's Qwen3-MoE has routed experts and a KV cache)
    for arm in arm_specs.values():
        excluded_modules(arm.trace, moe_layers=layers, attention_layers=layers)
        if arm.guided:
            check_guided_layers(arm.trace, guided_layers(arm.trace, model.num_layers), moe_layers=layers)


INIT_FROM_FIELDS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
                    "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
                    "head_dim": "head_dim", "num_experts": "num_experts", "top_k": "num_experts_per_tok",
                    "moe_intermediate_size": "moe_intermediate_size",
                    "max_position_embeddings": "max_position_embeddings"}
"""``TinyMoEConfig`` field -> the HF ``config.json`` key an ``init_from`` checkpoint gives it by."""


def check_init_from(init_from: str | Path, model: TinyMoEConfig | None = None) -> None:
    """``init_from`` must be a HF checkpoint directory over the demo's character vocabulary: the tasks, rewards and
    sentinel prompts are the demo's own token ids, which mean nothing to another vocabulary (a larger one failed only
    at the first reward, with a bare IndexError from the tokenizer's decode, after the trainer was built). Given
    ``model`` (the run's ``model.*``), the checkpoint must be that model: the arms' layer policies are checked against
    ``model`` and run.json records it, while the run trains the checkpoint's (an 8-layer checkpoint ran as recorded
    and checked as the 4-layer ``model.*``, silently)."""
    from .tasks import CharTokenizer

    path = Path(init_from) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"init_from={str(init_from)!r} is not a HF checkpoint directory (no config.json)")
    vocab, want = json.loads(path.read_text()).get("vocab_size"), CharTokenizer().vocab_size
    if vocab != want:
        raise ValueError(f"init_from={str(init_from)!r} has vocab_size={vocab!r}, not the demo's character "
                         f"vocabulary of {want} tokens (CharTokenizer: its tasks and rewards are the demo's own): "
                         "start from the demo's SFT checkpoint (outputs/sft_cache/<task>/: an arms=[] run prepares it)")
    if model is not None:
        _check_init_from_model(init_from, model)


def _check_init_from_model(init_from: str | Path, model: TinyMoEConfig) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(init_from))  # (as the run loads it: defaults for keys left out)
    differ = {f: (getattr(model, f), getattr(hf, key, None)) for f, key in INIT_FROM_FIELDS.items()
              if getattr(model, f) != getattr(hf, key, None)}
    if differ:
        said = ", ".join(f"model.{f}={mine} but {INIT_FROM_FIELDS[f]}={theirs!r}"
                         for f, (mine, theirs) in differ.items())
        fix = " ".join(f"model.{f}={theirs}" for f, (_, theirs) in differ.items())
        raise ValueError(f"init_from={str(init_from)!r} is another model than the run's: {said}; the run trains the "
                         f"checkpoint's model, so give its settings ({fix}) or start from a checkpoint of this model")


def check_resume_steps(out_dir: Path, arms: list[str], steps: int) -> None:
    """A resumed arm's checkpoint must not be past ``rl.steps`` (its loop ran nothing, silently: the summary then
    said ``steps`` RL steps of an arm trained for more)."""
    for name in arms:
        ckpt = out_dir / name / "ckpt.pt"
        if ckpt.exists():
            done = torch.load(ckpt, map_location="cpu", weights_only=False)["state"]["step"]
            if done > steps:
                raise ValueError(f"resume=true: arm {name!r}'s checkpoint {ckpt} is at step {done}, past rl.steps="
                                 f"{steps}: set rl.steps >= {done}, or start over with resume=false")


RUN_RECORD_PACKAGES = ("torch", "megatron-core", "transformers", "triton", "mbridge")


def run_record(**settings) -> dict:
    """What reproducing a run needs beside its settings (which hold the seeds): package versions, the git
    commit of this code (and whether its tree had uncommitted changes), Python and the platform."""
    import platform
    import subprocess
    from importlib import metadata

    from .. import __version__

    versions = {"megatron_trace": __version__}
    for name in RUN_RECORD_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    root = Path(__file__).resolve().parents[2]
    try:
        git = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True,  # noqa: E731
                                        timeout=30, check=True).stdout.strip()
        commit, dirty = git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):  # not a git checkout (an installed package) or no git
        commit, dirty = None, None
    return {"settings": settings, "versions": versions, "git_commit": commit, "git_dirty": dirty,
            "python": platform.python_version(), "platform": platform.platform(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_run_record(out_dir: Path, **settings) -> Path:
    """``out_dir/run.json`` (``run_record``); a resumed run appends its own record to ``runs`` beside the first."""
    path = Path(out_dir) / "run.json"
    rec = run_record(**settings)
    runs = json.loads(path.read_text()).get("runs", []) if settings.get("resume") and path.exists() else []
    path.write_text(json.dumps({**rec, "runs": [*runs, rec]}, indent=1, default=str) + "\n")
    return path


def _run_arm(name, arm, rl: RLConfig, task, hf_dir: str, out_dir: Path, writer, *, device: str, resume: bool,
             progress: bool) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from tqdm.auto import tqdm

    from ..monitor import MismatchGateError, SentinelError

    RouterReplay.clear_global_router_replay_instances()
    run_ = GRPORun(arm, rl, task, hf_dir, out_dir=out_dir / name, cache_dir=out_dir / "cache" / name, device=device)
    ckpt = out_dir / name / "ckpt.pt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    if resume and ckpt.exists():
        run_.load(ckpt)
    elif resume:  # (an arm the interrupted run never reached has none; any other restarts from step 0)
        logger.warning("resume=true but %s has no checkpoint: arm %s starts from step 0 (its rows so far are "
                       "dropped; rl.checkpoint_every=%d)", ckpt, name, rl.checkpoint_every)
    elif ckpt.exists():  # a fresh run starts over: an earlier run's checkpoint must not be resumed later
        logger.warning("resume=false: removing the earlier run's checkpoint %s", ckpt)
        ckpt.unlink()
    writer.truncate(name, run_.state.step)  # rows of steps after the checkpoint are redone
    start_acc = run_.evaluate() if run_.state.step == 0 else None
    for _ in tqdm(range(run_.state.step, rl.steps), desc=f"RL {name:<10}", disable=not progress):
        try:
            m = run_.step()
        except (MismatchGateError, SentinelError):
            writer.write(name, run_.state.step - 1, run_.last_metrics)  # the failing step's row, then the error
            raise
        if start_acc is not None:
            m["eval/accuracy_start"], start_acc = start_acc, None
        if run_.state.step == rl.steps:
            m["eval/accuracy"] = run_.evaluate()
        writer.write(name, run_.state.step - 1, m)
        if rl.checkpoint_every and run_.state.step % rl.checkpoint_every == 0:
            run_.save(ckpt)


def _summarize(path: Path, out_dir: Path, task_name: str, n_arms: int, steps: int) -> dict:
    by_arm = report.load(path)
    table = report.markdown_table(report.summary_rows(by_arm))
    try:
        plots = report.plot(by_arm, out_dir)
    except ImportError:  # matplotlib is in the examples extra
        logger.warning("matplotlib is not installed: no plots (pip install 'megatron_trace[examples]')")
        plots = []
    (out_dir / "summary.md").write_text(
        f"# TRACE demo: {task_name}, {n_arms} arms, {steps} RL steps\n\n{table}\n\n"
        + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n"
    )
    return by_arm
