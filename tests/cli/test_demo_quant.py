"""``python -m megatron_trace.cli.demo_quant``: its numbers against an independent computation, its defaults."""

import math
import re

import pytest
import torch

from megatron_trace.cli import demo_quant
from megatron_trace.cli.demo_quant import _activations, error_rows, main, mismatch_rows, parse_args
from megatron_trace.formats import Quantizer

MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1, code & 7 -> magnitude; code & 8: the sign


def _codes(q) -> torch.Tensor:
    """Unpacked 4-bit codes of an FP4 tensor, element 2i in the low nibble (not via the formats package)."""
    lo, hi = q.codes & 0xF, q.codes >> 4
    return torch.stack((lo, hi), -1).reshape(*q.codes.shape[:-1], -1).long()


def _grid_position(codes: torch.Tensor) -> torch.Tensor:
    """Position on the 15 distinct signed values -6 .. 6 (0 at position 7; -0 and +0 the same value)."""
    return torch.where(codes >= 8, -(codes & 7), codes & 7) + 7


def test_error_rows_are_each_formats_relative_rms_and_max_error_and_row_0_codes():
    x = _activations(4, 64, seed=0)
    rows = error_rows(x)
    assert [r[:2] for r in rows[1:]] == [["nvfp4", "per-tensor amax"], ["nvfp4", "per-row amax"],
                                         ["mxfp4", "floor"], ["mxfp4", "ceil"]]
    quantizers = [Quantizer("nvfp4", per_row=False), Quantizer("nvfp4", per_row=True),
                  Quantizer("mxfp4", scale_rule="floor"), Quantizer("mxfp4", scale_rule="ceil")]
    xd = x.double()
    for row, qz in zip(rows[1:], quantizers):
        q = qz.quantize(x)
        err = q.dequantize().double() - xd
        rel = math.sqrt(float((err**2).sum()) / float((xd**2).sum()))
        assert float(row[2]) == pytest.approx(rel, abs=6e-5), row
        assert float(row[3]) == pytest.approx(float(err.abs().max()), abs=6e-5), row
        assert row[4] == " ".join(format(int(c), "x") for c in _codes(q)[0, :16]), row


@pytest.mark.parametrize("noise", [0.3, 0.0])
def test_mismatch_rows_count_the_codes_that_differ_from_the_rollouts_and_their_adjacent_share(noise):
    """x' = x + noise x std(x) x N(0, 1) (seed + 1, as documented); each row: the share of x' codes whose value
    differs from the rollout's, and the share of those one grid step away."""
    x, seed = _activations(4, 64, seed=0), 0
    g = torch.Generator().manual_seed(seed + 1)
    xp = (x.float() + noise * x.float().std() * torch.randn(x.shape, generator=g)).to(torch.bfloat16)
    rows = mismatch_rows(x, noise, seed)
    want = [["trainer rounding", "code mismatch vs rollout", "adjacent share"]]
    for fmt in ("nvfp4", "mxfp4"):
        qz = Quantizer(fmt, per_row=fmt == "nvfp4")
        roll = qz.quantize(x)
        ref = _grid_position(_codes(roll))
        for label, q in ((f"{fmt} RNE (own scales)", qz.quantize(xp)),
                         (f"{fmt} guided, full codes", qz.guided_quantize(xp, roll.guidance(compact=False))),
                         (f"{fmt} guided, mantissa bit", qz.guided_quantize(xp, roll.guidance(compact=True)))):
            pos = _grid_position(_codes(q))
            diff = pos != ref
            n = int(diff.sum())
            share = f"{int(((pos - ref).abs() == 1).sum()) / n:.1%}" if n else "-"
            want.append([label, f"{n / diff.numel():.3%}", share])
    assert rows == want
    if noise:  # the rows discriminate: own rounding mismatches more than guided, full codes are not the compact bit
        assert float(rows[1][1][:-1]) > float(rows[2][1][:-1]) and rows[2] != rows[3]
    else:
        assert all(r[1:] == ["0.000%", "-"] for r in rows[1:])


def test_defaults_are_the_documented_ones():
    """The usage line ``[--rows 256] [--k 2048] [--noise 0.01] [--seed 0]`` states the defaults."""
    documented = dict(re.findall(r"\[--(\w+) ([\d.]+)\]", demo_quant.__doc__))
    assert documented.keys() == {"rows", "k", "noise", "seed"}
    args = vars(parse_args([]))
    assert {k: type(args[k])(v) for k, v in documented.items()} == args


def test_zero_noise_is_accepted():
    """``--noise`` must be a finite number >= 0: 0 (the trainer computes what the rollout did) is allowed."""
    main(["--rows", "2", "--k", "32", "--noise", "0"])


def test_setup_pys_console_scripts_resolve_and_the_readme_names_them():
    """Each ``console_scripts`` entry of setup.py names a callable ``main`` taking argv (the installed script calls it
    without arguments), and the README names the script (``trace-demo-quant`` was installed, never mentioned)."""
    import ast
    import importlib
    import inspect
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    call = next(n for n in ast.walk(ast.parse((root / "setup.py").read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    entry_points = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "entry_points"))
    scripts = dict(s.replace(" ", "").split("=") for s in entry_points["console_scripts"])
    assert scripts, "setup.py installs no console script"
    readme = (root / "README.md").read_text()
    for name, target in scripts.items():
        module, func = target.split(":")
        fn = getattr(importlib.import_module(module), func)
        assert next(iter(inspect.signature(fn).parameters.values())).default is None, target  # main(argv=None)
        assert f"`{name}`" in readme, name
