"""A small FP4 quantization demo: error per format and guided vs RNE mismatch on a perturbed copy.

  python -m megatron_trace.cli.demo_quant [--rows 256] [--k 2048] [--noise 0.01] [--seed 0]

It quantizes a heavy-tailed bf16 activation-like tensor x (the "rollout"), then a perturbed copy
x' (the "trainer", as if computed by another kernel), and counts how often the trainer's codes
differ from the rollout's with plain RNE (its own scales) and TRACE guided rounding in full and
compact (mantissa bit) mode, and which share of those differ by one grid step.
"""

from __future__ import annotations

import argparse

import torch

from ..formats import Quantizer, e2m1


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows[1:])])


def _activations(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g).add(0.1)
    outliers = torch.rand(rows, k, generator=g) < 0.002
    return torch.where(outliers, x * 20, x).to(torch.bfloat16)


def error_rows(x: torch.Tensor) -> list[list[str]]:
    out = [["format", "scale rule / amax", "rel. RMS error", "max abs error", "codes of row 0 (first 16)"]]
    xf = x.float()
    for name, qz in (
        ("nvfp4", Quantizer("nvfp4", per_row=False)),
        ("nvfp4", Quantizer("nvfp4", per_row=True)),
        ("mxfp4", Quantizer("mxfp4", scale_rule="floor")),
        ("mxfp4", Quantizer("mxfp4", scale_rule="ceil")),
    ):
        q = qz.quantize(x)
        err = q.dequantize() - xf
        rule = ("per-row amax" if qz.per_row else "per-tensor amax") if name == "nvfp4" else qz.scale_rule
        codes = " ".join(f"{c:x}" for c in q.unpacked_codes()[0, :16].tolist())
        out.append([name, rule, f"{(err.norm() / xf.norm()).item():.4f}", f"{err.abs().max().item():.4f}", codes])
    return out


def mismatch_rows(x: torch.Tensor, noise: float, seed: int) -> list[list[str]]:
    g = torch.Generator().manual_seed(seed + 1)
    xp = (x.float() + noise * x.float().std() * torch.randn(x.shape, generator=g)).to(torch.bfloat16)
    out = [["trainer rounding", "code mismatch vs rollout", "adjacent share"]]
    for fmt in ("nvfp4", "mxfp4"):
        qz = Quantizer(fmt, per_row=fmt == "nvfp4")
        roll = qz.quantize(x)
        q_roll = roll.values()
        own = qz.quantize(xp)
        candidates = {
            f"{fmt} RNE (own scales)": own.values(),
            f"{fmt} guided, full codes": qz.guided_quantize(xp, roll.guidance(compact=False)).values(),
            f"{fmt} guided, mantissa bit": qz.guided_quantize(xp, roll.guidance(compact=True)).values(),
        }
        for label, q in candidates.items():
            diff = q != q_roll
            adjacent = _adjacent(q, q_roll)[diff]
            share = f"{adjacent.float().mean().item():.1%}" if diff.any() else "-"
            out.append([label, f"{diff.float().mean().item():.3%}", share])
    return out


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(e2m1.SIGNED_GRID)
    ia, ib = torch.searchsorted(grid, a.contiguous()), torch.searchsorted(grid, b.contiguous())
    return (ia - ib).abs() == 1


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be >= 1")
    return n


def _noise(text: str) -> float:
    v = float(text)
    if not 0 <= v < float("inf"):  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0")
    return v


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=_positive, default=256)
    p.add_argument("--k", type=_positive, default=2048)
    p.add_argument("--noise", type=_noise, default=0.01, help="trainer perturbation, relative to the tensor's std")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    x = _activations(a.rows, a.k, a.seed)
    print(f"FP4 quantization of a bf16 tensor [{a.rows}, {a.k}] (heavy-tailed activations)\n")
    print(_table(error_rows(x)))
    print(f"\nTrainer input = rollout input + {a.noise} x std noise (a different kernel's rounding):\n")
    print(_table(mismatch_rows(x, a.noise, a.seed)))


if __name__ == "__main__":
    main()
