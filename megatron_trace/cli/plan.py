"""Plan the guidance cache of a large run before having the GPUs.

  python -m megatron_trace.plan --hf-config config.json --trajectories 4096 --response-len 8192 \\
      --layer-policy all --layer-policy fraction=0.5 --layer-policy last_k=10 [--json]

Reads an HF MoE ``config.json`` (Qwen3-MoE, Qwen3.5-MoE, DeepSeek-V3 key names; see
``guidance.model_dims`` for what is counted) and prints, for full vs compact records and each
layer policy: guidance bytes per token, bytes per RL step (trajectories x (prompt + response)
tokens), host memory (what the guidance cache holds for the steps in flight: the guidance plus every row's valid
flag and the FC2 rows' expert ids, exact) and the time to sync one step at the given link bandwidth (gigabits per
second, one link, no overlap: one ``GuidanceSync`` transfer of the step, its payload with the valid flags, expert
ids and routing, its size message and a bound of its header; ``guidance.planner.plan_row``).

``--dp-ranks N`` (repeatable) adds, per row, what one of N trainer data-parallel ranks receives per step (its
samples' guidance, routing, host cache and ``GuidanceSync`` payload bytes, exact) and the sync time at
``--bandwidth-gbytes NAME=GB/s`` (repeatable; e.g. bandwidths measured by benchmarks/ep_scaling.py).

Layer policies: ``none``, ``all``, ``last_k=N``, ``fraction=F`` (deepest ceil(F x layers)),
``explicit=I,J,...``, ``budget=BYTES_PER_TOKEN``: the layers removing the most code mismatch per byte within the
budget (``guidance.planner.budget_layers``). It needs ``--mismatch-profile``: per-layer code-mismatch *rates* (the
fraction of a layer's guided elements whose FP4 code differs, in [0, 1]), either a JSON list (or ``{"layer":
rate}``) or a run's ``metrics.jsonl`` (the demo's ``quant/<site>/layer_<L>/code_mismatch_rate`` of ``--mismatch-arm``,
an FP4 arm without guidance such as ``fp4_qat``, averaged over its last ``--mismatch-last`` measured steps and
weighted over the ``--sites`` by their elements; ``guidance.mismatch_profile``). ``--mismatch-unit mass`` reads a
JSON profile as per-layer mismatch masses instead (mismatched codes guiding the layer removes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import ACTIVATION_SITES, CACHE_MODES, KV_FORMATS, TraceConfig
from ..formats import FORMATS
from ..guidance.accounting import AMAX_MODES
from ..guidance.mismatch_profile import profile_from_metrics
from ..guidance.model_dims import ModelDims
from ..guidance.planner import PROFILE_UNITS, RLSettings, plan_row, rank_projection

DEFAULT_POLICIES = ("all", "fraction=0.5", "fraction=0.25", "fraction=0.125")


def policy_kwargs(policy: str) -> dict:
    """TraceConfig fields of a ``--layer-policy`` string."""
    name, _, arg = policy.partition("=")
    if name == "explicit":  # (a layer given twice is refused outside the try: not a "bad argument" of int())
        return {"guided_layers": "explicit", "guided_layer_list": _once(_ints(arg, policy), policy)}
    try:
        if name in ("none", "all") and not arg:
            return {"guided_layers": name}
        if name == "last_k":
            return {"guided_layers": "last_k", "guided_last_k": int(arg)}
        if name == "fraction":
            return {"guided_layers": "fraction", "guided_fraction": float(arg)}
        if name == "budget":
            return {"guided_layers": "budget", "budget_bytes_per_token": float(arg)}
    except ValueError as e:
        raise ValueError(f"--layer-policy {policy!r}: bad argument ({e})") from e
    raise ValueError(
        f"--layer-policy {policy!r} is not one of none, all, last_k=N, fraction=F, explicit=I,J,..., budget=BYTES"
    )


def _ints(arg: str, policy: str) -> tuple[int, ...]:
    try:
        return tuple(int(i) for i in arg.split(","))
    except ValueError as e:
        raise ValueError(f"--layer-policy {policy!r}: bad argument ({e})") from e


def _once(ids: tuple[int, ...], policy: str) -> tuple[int, ...]:
    """``ids`` with no layer given twice (it was sized as the set, while ``--trace-guided-layers`` refuses it)."""
    twice = sorted({i for i in ids if ids.count(i) > 1}, key=ids.index)
    if twice:
        raise ValueError(f"--layer-policy {policy!r}: layer(s) {', '.join(map(str, twice))} given twice; name each "
                         "layer once")
    return ids


def build_rows(dims: ModelDims, rl: RLSettings, *, policies, modes, fmt, amax, sites, profile=None,
               profile_unit="rate", dp_ranks=(), bandwidths=None, kv_format="") -> list[dict]:
    rows = []
    for policy in policies:
        for mode in modes:
            cfg = TraceConfig(format=fmt, kv_format=kv_format, activation_amax=amax, guided_sites=tuple(sites),
                              cache_mode=mode, **policy_kwargs(policy))
            kw = {"mismatch_profile": profile, "profile_unit": profile_unit} if cfg.guided_layers == "budget" else {}
            row = plan_row(dims, cfg, rl, policy, **kw)
            if dp_ranks:
                row["per_rank"] = [rank_projection(dims, cfg, rl, dp_ranks=n, bandwidths_gbytes=bandwidths,
                                                   layers=row["layers"]) for n in dp_ranks]
            rows.append(row)
    return rows


def read_profile(args: argparse.Namespace, dims: ModelDims, sites) -> list | dict | None:
    """The ``--mismatch-profile``: a JSON list / ``{layer: value}`` object, or per-layer rates of a metrics.jsonl."""
    path = args.mismatch_profile
    if path is None:
        return None
    if path.suffix == ".jsonl":
        if args.mismatch_unit != "rate":
            raise ValueError(f"--mismatch-profile {path} holds code-mismatch rates: --mismatch-unit "
                             f"{args.mismatch_unit} applies to a JSON profile only")
        return profile_from_metrics(path, dims, sites, arm=args.mismatch_arm, last=args.mismatch_last)
    try:
        profile = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--mismatch-profile {path} is not JSON ({e}); a run's metrics file must end in .jsonl") from e
    if isinstance(profile, dict):
        bad = [k for k in profile if not k.strip().isdigit()]
        if bad:
            raise ValueError(f"--mismatch-profile {path} has key(s) {bad[:5]}: a JSON object's keys are layer ids "
                             '0, 1, ... ({"0": rate, "1": rate, ...}), or give a JSON list')
        profile = {int(k): v for k, v in profile.items()}
    return profile


def check_profile_flags(args: argparse.Namespace) -> None:
    """Refuse a ``--mismatch-*`` flag that would do nothing (as ``--bandwidth-gbytes`` without ``--dp-ranks``): the
    profile is read for a ``budget=`` policy only, ``--mismatch-arm`` / ``--mismatch-last`` pick rows of a
    metrics.jsonl profile only, ``--mismatch-unit`` reads a profile. Flags at their default value are accepted."""
    path, policies = args.mismatch_profile, args.policies or DEFAULT_POLICIES
    if path is not None and not any(p.partition("=")[0] == "budget" for p in policies):
        raise ValueError(f"--mismatch-profile {path} would do nothing: only a --layer-policy budget=BYTES reads it, "
                         f"and the policies are {list(policies)}; add --layer-policy budget=BYTES")
    jsonl = path is not None and path.suffix == ".jsonl"
    defaults = parse_args(["--hf-config", "-"])
    for flag, name in (("--mismatch-arm", "mismatch_arm"), ("--mismatch-last", "mismatch_last")):
        value = getattr(args, name)
        if value != getattr(defaults, name) and not jsonl:
            raise ValueError(f"{flag} {value} would do nothing: it picks the rows of a run's metrics.jsonl "
                             f"--mismatch-profile, and the profile is {str(path) if path else 'not given'}")
    if args.mismatch_unit != defaults.mismatch_unit and path is None:
        raise ValueError(f"--mismatch-unit {args.mismatch_unit} would do nothing without a JSON --mismatch-profile")


def parse_bandwidths(items) -> dict[str, float]:
    """``NAME=GBPS`` strings -> {name: GB/s}."""
    out = {}
    for item in items or ():
        name, sep, val = item.rpartition("=")
        key = name if sep else f"{val} GB/s"
        if key in out:  # (the later value replaced the earlier one)
            raise ValueError(f"--bandwidth-gbytes names {key!r} twice: give each bandwidth once")
        try:
            out[key] = float(val)
        except ValueError as e:
            raise ValueError(f"--bandwidth-gbytes {item!r}: want NAME=GB/s, e.g. measured=20.5 ({e})") from e
    return out


def format_ranks(rows: list[dict]) -> str:
    """Per trainer rank lines of rows that have ``per_rank``."""
    lines = []
    for r in rows:
        for p in r.get("per_rank", ()):
            sync = ", ".join(f"{seconds(s)} @ {name}" for name, s in p["sync_seconds"].items())
            lines.append(f"{r['policy']} {r['mode']}, {p['dp_ranks']} DP ranks: {p['samples_per_rank']} samples, "
                         f"guidance {human(p['guidance_bytes_per_rank'])}, routing {human(p['routing_bytes_per_rank'])}"
                         f", host cache {human(p['cache_host_bytes_per_rank'])}, sync payload "
                         f"{human(p['sync_payload_bytes_per_rank'])}" + (f"; sync {sync}" if sync else ""))
    return "\n".join(["", "per trainer rank:", *lines]) if lines else ""


def human(n: float, unit: str = "B") -> str:
    for prefix in ("", "Ki", "Mi", "Gi", "Ti", "Pi"):
        if abs(n) < 1024 or prefix == "Pi":
            return f"{n:.1f} {prefix}{unit}" if prefix else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def seconds(s: float) -> str:
    return f"{s:.2f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def format_table(dims: ModelDims, rl: RLSettings, rows: list[dict], sites=ACTIVATION_SITES) -> str:
    """The table of ``rows``, the launch flags of each budget choice after it (``sites``: the guided sites the rows
    were sized for, ``--sites``)."""
    kv = f"{dims.kv_heads}x{dims.head_dim}" + ("" if dims.kv_v else " (MLA latent, K only)")
    lines = [
        f"model {dims.name or '?'}: {dims.num_layers} layers ({len(dims.moe_layers)} MoE, "
        f"{len(dims.kv_layers)} with KV),"
        f" hidden {dims.hidden}, expert ffn {dims.moe_ffn}, top-{dims.topk}, KV rows {kv}",
        f"step: {rl.trajectories} trajectories x ({rl.prompt_len} + {rl.response_len}) tokens = "
        f"{rl.tokens_per_step:,} tokens; link {rl.bandwidth_gbps:g} Gbit/s; {rl.steps_in_flight} step(s) in flight",
        "",
    ]
    head = ("policy", "mode", "layers", "bytes/token", "bytes/step", "host memory", "sync time")
    table = [head] + [
        (r["policy"], r["mode"], str(r["num_layers"]), human(r["bytes_per_token"]), human(r["bytes_per_step"]),
         human(r["host_bytes"]), seconds(r["sync_seconds"]))
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for j, row in enumerate(table):
        lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    chosen = {(r["policy"], r["mode"], r["format"], r["kv_format"], tuple(r["layers"])) for r in rows
              if r["policy"].startswith("budget")}
    for policy, mode, fmt, kv_fmt, layers in sorted(chosen):  # the launch flags each choice was sized for
        ids = ",".join(map(str, layers))
        kv = f" --trace-kv-format {kv_fmt}" if kv_fmt else ""
        # (the guided sites too: a launch without them guided all four sites on these layers, over the budget)
        guided = "" if not ids else f" --trace-guided-sites {','.join(sites)}"
        lines.append(f"{policy} {mode} guides layers {ids or '(none)'}: --trace-format {fmt}{kv} --trace-cache-mode "
                     f"{mode} --trace-guided-layers {ids or 'none'}{guided}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_trace.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-config", required=True, type=Path, help="HF config.json of an MoE model")
    p.add_argument("--trajectories", type=int, default=4096, help="trajectories (sequences) per RL step")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens per trajectory")
    p.add_argument("--response-len", type=int, default=8192, help="response tokens per trajectory")
    p.add_argument("--bandwidth-gbps", type=float, default=400.0, help="rollout->trainer link, gigabits/s")
    p.add_argument("--steps-in-flight", type=int, default=1, help="steps held on the host at once (async RL)")
    p.add_argument("--format", choices=FORMATS, default="nvfp4")
    p.add_argument("--kv-format", choices=KV_FORMATS, default="",
                   help="the K/V sites' format (TraceConfig.kv_format): '' = --format; sglang_kvfp4 = SGLang's FP4 KV "
                   "cache (no per-row amax)")
    p.add_argument("--amax", choices=AMAX_MODES, default="per_row",
                   help="NVFP4 activation global amax (the sizes do not change: the recorders store it per row)")
    p.add_argument("--sites", default=",".join(ACTIVATION_SITES), help="comma list of guided sites")
    p.add_argument("--modes", default="full,compact", help=f"comma list of {CACHE_MODES}")
    p.add_argument("--layer-policy", action="append", dest="policies", help=f"repeatable; default {DEFAULT_POLICIES}")
    p.add_argument("--mismatch-profile", type=Path,
                   help="budget policy: per-layer code-mismatch rates, a JSON list or a run's metrics.jsonl")
    p.add_argument("--mismatch-unit", choices=PROFILE_UNITS, default="rate",
                   help="what a JSON --mismatch-profile holds: rates in [0, 1] (default) or per-layer masses")
    p.add_argument("--mismatch-arm", help="the arm of a metrics.jsonl profile (default: the only one with per-layer "
                   "rates; name an FP4 arm without guidance, e.g. fp4_qat)")
    p.add_argument("--mismatch-last", type=int, default=3, help="steps of a metrics.jsonl profile averaged (last N)")
    p.add_argument("--dp-ranks", type=int, action="append", default=[],
                   help="repeatable: also size one of N trainer data-parallel ranks' share per step")
    p.add_argument("--bandwidth-gbytes", action="append", default=[], metavar="NAME=GBPS",
                   help="repeatable: sync time of a rank's share at this bandwidth (GB/s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        dims = ModelDims.from_hf_config(args.hf_config)
        rl = RLSettings(args.trajectories, args.prompt_len, args.response_len, args.bandwidth_gbps,
                        args.steps_in_flight)
        if args.bandwidth_gbytes and not args.dp_ranks:
            raise ValueError(f"--bandwidth-gbytes {' '.join(args.bandwidth_gbytes)} times a trainer rank's share: add "
                             "--dp-ranks N (the table's sync time is at --bandwidth-gbps)")
        modes = [m for m in args.modes.split(",") if m]
        for flag, values in (("--modes", modes), ("--layer-policy", args.policies or []),
                             ("--dp-ranks", args.dp_ranks)):
            if len(set(values)) < len(values):  # (the table repeated their rows)
                raise ValueError(f"{flag} {values} gives a value more than once: give each once")
        sites = [s for s in args.sites.split(",") if s]
        for flag, values, valid in (("--modes", modes, CACHE_MODES), ("--sites", sites, ACTIVATION_SITES)):
            if not values:  # (no row was printed, or every row sized 0 bytes)
                raise ValueError(f"{flag} {getattr(args, flag[2:])!r} names none of {valid}: give a comma list")
        check_profile_flags(args)
        profile = read_profile(args, dims, sites)
        rows = build_rows(
            dims, rl, policies=args.policies or DEFAULT_POLICIES, modes=modes,
            fmt=args.format, amax=args.amax, sites=sites, profile=profile, profile_unit=args.mismatch_unit,
            dp_ranks=args.dp_ranks, bandwidths=parse_bandwidths(args.bandwidth_gbytes), kv_format=args.kv_format,
        )
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = {"model": dims.__dict__, "rl": rl.__dict__, "rows": rows}
        if profile is not None:
            out["mismatch_profile"] = {"unit": args.mismatch_unit, "values": profile}
        print(json.dumps(out, indent=1, default=list))
    else:
        print(format_table(dims, rl, rows, sites) + format_ranks(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
