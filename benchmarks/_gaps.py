"""Where a profiled step leaves the GPU idle: gaps between device activities in a torch.profiler Chrome trace.

A training step is GPU-bound only where the host stays ahead of the device. After a host sync the device queue is
empty, and every microsecond the host then spends before its next launch is device idle time. ``idle_gaps`` lists
the gaps between consecutive kernels / copies / memsets (one device), each with the host ops that enclosed the launch
of the activity after the gap (innermost first), whether the host launched it after the gap had begun (the
device waited for the host) or before (launch latency, a dependency), the activity before the gap and the host ops
running when the gap began.
"""

from __future__ import annotations

import bisect
import json

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def idle_gaps(trace: dict | str, top: int = 25, min_us: float = 20.0) -> dict:
    """Summary of the device idle time of a Chrome trace (a dict or a path): the idle total between the first and
    last device activity, the gaps of at least ``min_us`` summed by the host op that launched the next activity,
    and the ``top`` largest gaps."""
    if isinstance(trace, str):
        with open(trace) as fh:
            trace = json.load(fh)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    dev = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    if not dev:
        return {"device_activities": 0}
    launches = {e["args"]["correlation"]: e for e in events  # (Triton launches by the driver API)
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("cat") in ("cpu_op", "user_annotation")), key=lambda e: e["ts"])
    starts = [e["ts"] for e in ops]
    gaps, busy_end, prev = [], dev[0]["ts"] + dev[0]["dur"], dev[0]
    for e in dev[1:]:
        gap = e["ts"] - busy_end
        if gap >= min_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            host = _enclosing(ops, starts, launch["ts"], launch.get("tid")) if launch else []
            late = launch is not None and launch["ts"] > busy_end
            gaps.append((gap, e["name"][:60], host, late, prev["name"][:40], _enclosing(ops, starts, busy_end)))
        if e["ts"] + e["dur"] > busy_end:
            busy_end, prev = e["ts"] + e["dur"], e
    span = busy_end - dev[0]["ts"]
    busy = _union_us(dev)
    by_op: dict[str, list[float]] = {}
    for gap, _, host, *_ in gaps:
        key = " < ".join(host[:2]) or "(no host op)"
        by_op.setdefault(key, []).append(gap)
    ranked = sorted(by_op.items(), key=lambda kv: -sum(kv[1]))
    return {
        "device_activities": len(dev),
        "span_ms": round(span / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3),
        "idle_ms": round((span - busy) / 1e3, 3),
        "gaps_over_min": len(gaps),
        "gaps_over_min_ms": round(sum(g[0] for g in gaps) / 1e3, 3),
        "host_late_ms": round(sum(g[0] for g in gaps if g[3]) / 1e3, 3),
        "by_launching_op": [[k, len(v), round(sum(v) / 1e3, 3)] for k, v in ranked[:top]],
        # [ms, activity after the gap, host ops at its launch, launched late, activity before, host ops at the start]
        "top_gaps": [[round(g / 1e3, 3), name, " < ".join(host[:4]), late, before, " < ".join(at[:3])]
                     for g, name, host, late, before, at in sorted(gaps, key=lambda g: -g[0])[:top]],
    }


def _enclosing(ops: list[dict], starts: list[float], ts: float, tid=None) -> list[str]:
    """Names of the host ops running at ``ts`` (on thread ``tid`` if given), innermost (latest start) first."""
    i = bisect.bisect_right(starts, ts)
    return [e["name"][:60] for e in reversed(ops[:i])
            if e["ts"] + e["dur"] >= ts and (tid is None or e.get("tid") == tid)]


def _union_us(dev: list[dict]) -> float:
    """Microseconds covered by at least one device activity (they may overlap across streams)."""
    total, cur_s, cur_e = 0.0, None, None
    for e in dev:
        s, t = e["ts"], e["ts"] + e["dur"]
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    return total + (cur_e - cur_s)
