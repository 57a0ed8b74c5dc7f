"""Outputs of a demo run: metrics.jsonl (one line per arm and step), summary.md, PNG plots, TensorBoard."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections import defaultdict
from pathlib import Path

from ..rollout.base import is_int, is_real

logger = logging.getLogger(__name__)

SUMMARY_KEYS = (
    ("reward", "final reward (last 3 steps)"),
    ("eval/accuracy", "held-out greedy accuracy"),
    ("mismatch/logprob_abs_diff", "logprob_abs_diff"),
    ("mismatch/kl_k3", "kl_k3"),
    ("mismatch/token_mult_prob_error", "token_mult_prob_error"),
    ("quant/expert_fc1_in/code_mismatch_rate", "FC1 code mismatch"),
    ("quant/guided/code_mismatch_rate", "code mismatch at guided sites"),
    ("cache/bytes_per_token", "guidance bytes/token"),
    ("time/step_s", "step time (s)"),
)


class MetricsWriter:
    """Appends one JSON line per (arm, step) and mirrors scalars to TensorBoard when available."""

    def __init__(self, out_dir: Path, *, fresh: bool = False):
        """``fresh``: start over (an earlier run's metrics.jsonl and TensorBoard events removed)."""
        if not isinstance(fresh, bool):  # (a config's "no" is truthy: the earlier run's metrics were deleted)
            raise ValueError(f"fresh={fresh!r} must be a bool (True: remove the earlier run's metrics.jsonl and "
                             "TensorBoard events)")
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not self.out_dir.is_dir():  # (mkdir's bare "File exists")
            raise NotADirectoryError(f"out_dir={os.fspath(out_dir)!r} is a file: give the run's output directory "
                                     "(made if missing)")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self._tb, self._purge = {}, {}
        if fresh:
            self.path.unlink(missing_ok=True)
            shutil.rmtree(self.out_dir / "tb", ignore_errors=True)

    def truncate(self, arm: str, step: int) -> None:
        """Drop ``arm``'s rows of steps >= ``step`` (a resumed run redoes them; they are not counted twice), and an
        unfinished last row (no line end: the run died writing it; its step came after the last checkpoint, so it is
        redone too). The file is replaced whole: a run killed meanwhile keeps the old one. The arm's TensorBoard
        events of steps >= ``step`` are purged too (its next events file starts with ``purge_step``: a redone step
        appeared there twice)."""
        _check_row_key(arm, step)
        self._purge[arm] = step
        if self._tb.get(arm) is not None:  # (a writer opened before: the next one purges)
            self._tb.pop(arm).close()
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        cut = bool(lines) and not lines[-1].endswith("\n")
        if cut:
            logger.warning("%s: dropping its unfinished last row (the interrupted run died writing it)", self.path)
            lines = lines[:-1]
        keep = [ln for ln in lines if not ((r := json.loads(ln))["arm"] == arm and r["step"] >= step)]
        if len(keep) != len(lines):
            logger.info("%s: dropping %d row(s) of steps >= %d (redone after the resume)", arm,
                        len(lines) - len(keep), step)
        if cut or len(keep) != len(lines):
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(keep))
            os.replace(tmp, self.path)

    def write(self, arm: str, step: int, metrics: dict) -> None:
        _check_row_key(arm, step)
        row = {"arm": arm, "step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        tb = self._writer(arm)
        if tb is not None:
            for k, v in row.items():
                if isinstance(v, float):  # (NaN / Inf too: TensorBoard marks them; they were left out, silently)
                    tb.add_scalar(k, v, step)

    def _writer(self, arm: str):
        if arm not in self._tb:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb[arm] = SummaryWriter(str(self.out_dir / "tb" / arm), purge_step=self._purge.get(arm))
            except ImportError:  # tensorboard is in the examples extra
                self._tb[arm] = None
        return self._tb[arm]

    def close(self) -> None:
        for w in self._tb.values():
            if w is not None:
                w.close()


def _check_row_key(arm, step) -> None:
    """A row's arm is a str and its step an int (a step "3" or 2.5 was written as such, and the resume's
    ``truncate`` compared it with an int: a TypeError, or a redone step kept twice)."""
    if not isinstance(arm, str):
        raise ValueError(f"arm={arm!r} must be the arm's name (a str)")
    if not is_int(step):
        raise ValueError(f"step={step!r} must be an int (the RL step)")


def _clean(v):
    if hasattr(v, "item"):
        v = v.item()
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v


def load(path: Path) -> dict[str, list[dict]]:
    by_arm = defaultdict(list)
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        by_arm[row["arm"]].append(row)
    return dict(by_arm)


def _mean_last(rows: list[dict], key: str, n: int = 1) -> float | None:
    """Mean of ``key`` over the last ``n`` rows that have it (None: no row has it). A value that is no number (a
    JSON null) is NaN in the mean: it was dropped, and the cell showed the mean of other steps as these."""
    vals = [_number(r[key]) for r in rows if key in r][-n:]
    return sum(vals) / len(vals) if vals else None


def _number(v) -> float:
    return float(v) if is_real(v) else math.nan


FLOOR_ARM = "bf16"
FLOOR_KEY = "mismatch/logprob_abs_diff"
FLOOR_LABEL = "logprob_abs_diff / bf16 floor"
"""The headline acceptance check (USER_NEEDS.md §2): an arm's mismatch over the BF16<->BF16 floor of the same run
(same topology, seed and prompts); a column of the summary when the run has the ``bf16`` arm."""


def _cell(v: float | None) -> str:
    return "-" if v is None else (f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}")


def summary_rows(by_arm: dict[str, list[dict]]) -> list[list[str]]:
    has_floor = FLOOR_ARM in by_arm
    floor = _mean_last(by_arm[FLOOR_ARM], FLOOR_KEY, len(by_arm[FLOOR_ARM])) if has_floor else None
    header = ["arm"]
    for key, label in SUMMARY_KEYS:
        header += [label, FLOOR_LABEL] if has_floor and key == FLOOR_KEY else [label]
    out = [header]
    for arm, rows in by_arm.items():
        cells = [arm]
        for key, _ in SUMMARY_KEYS:
            n = 3 if key == "reward" else (len(rows) if key.startswith(("mismatch/", "quant/", "time/")) else 1)
            v = _mean_last(rows, key, n)
            cells.append(_cell(v))
            if has_floor and key == FLOOR_KEY:
                cells.append(f"{v / floor:.3g}x" if v is not None and floor else "-")
        out.append(cells)
    return out


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def plot(by_arm: dict[str, list[dict]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    paths = []

    def series(key):
        return {a: ([r["step"] for r in rows if key in r], [r[key] for r in rows if key in r])
                for a, rows in by_arm.items()}

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, (x, y) in series("reward").items():
        ax.plot(x, y, marker=".", label=arm)
    ax.set(xlabel="RL step", ylabel="mean sampled reward", title="Reward per step")
    ax.legend()
    paths.append(_save(fig, out_dir / "reward.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("mismatch/logprob_abs_diff", "mismatch/kl_k3")):
        for arm, (x, y) in series(key).items():
            ax.plot(x, y, marker=".", label=arm)
        ax.set(xlabel="RL step", ylabel=key.split("/")[1], yscale="log", title=f"Train-rollout {key.split('/')[1]}")
    axes[0].legend()
    paths.append(_save(fig, out_dir / "mismatch.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    width, shown, ticks = 0.4, [a for a in ("fp4_qat", "trace") if a in by_arm], set()
    for i, arm in enumerate(shown):
        last = next((r for r in reversed(by_arm[arm]) if "quant/expert_fc1_in/code_mismatch_rate" in r), {})
        layers = sorted(int(k.split("layer_")[1].split("/")[0]) for k in last
                        if k.startswith("quant/expert_fc1_in/layer_") and k.endswith("/code_mismatch_rate"))
        vals = [last[f"quant/expert_fc1_in/layer_{layer}/code_mismatch_rate"] for layer in layers]
        ax.bar([layer + (i - (len(shown) - 1) / 2) * width for layer in layers], vals, width=width, label=arm)
        ticks.update(layers)
    ax.set_xticks(sorted(ticks))  # (bars centred on their layer, one tick per layer)
    ax.set(xlabel="layer", ylabel="code mismatch rate", title="FC1-input code mismatch per layer (last measured step)")
    ax.legend()
    paths.append(_save(fig, out_dir / "code_mismatch_per_layer.png"))

    arms = [a for a in ("trace", "trace_full") if a in by_arm]
    if arms:
        fig, ax = plt.subplots(figsize=(5, 4))
        # the summary's cell: the last row that has it (a row without it, e.g. a resumed run's, drew a bar of 0)
        vals = [_mean_last(by_arm[a], "cache/bytes_per_token") for a in arms]
        ax.bar(arms, [math.nan if v is None else v for v in vals], color=["C3", "C4"][: len(arms)])
        ax.set(ylabel="bytes / token", title="Guidance cache per token")
        paths.append(_save(fig, out_dir / "cache_bytes.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
