"""A skewed packed micro-batch's guidance: assembled batch-major and moved by ``pack_step`` (B x max_len held) vs
assembled straight into the packed row (``layout=PackedLayout``): wall time and peak RSS growth per path.

    PYTHONPATH=. TORCHDYNAMO_DISABLE=1 python benchmarks/bench_packed_assembly.py [--long 8192] [--short 1024]
        [--samples 8] [--modes compact]

Dims and records as ``bench_long_context.py`` (Qwen3-30B-A3B, default ``TraceConfig``: 24 guided layers x 4 sites,
43,104 B/token compact): one sample of ``--long`` tokens and ``--samples - 1`` of ``--short``, each padded to a
multiple of 8 in the packed row (``cu_seqlens_padded``, as verl pads). Paths, each timed once on the same stored
guidance (``measured``: wall and CPU seconds, peak RSS growth):

  columns_padded  assemble_packed batch-major [B, long, ...] then pack_step into [1, T, ...]
  columns_direct  assemble_packed(layout=...) into [1, T, ...]
  samples_padded  records.assemble of per-sample records batch-major, then pack_step
  samples_direct  records.assemble(layout=...)

``x`` is peak / the packed row's guidance payload (``accounting`` bytes per token x the samples' tokens). The two
paths' results are compared bit for bit, and their counts (``equal``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
from bench_long_context import base_records, make_batch, malloc_returns_memory, measured, setup, tokens_of  # noqa: E402

from megatron_trace.guidance.layout import PackedLayout  # noqa: E402
from megatron_trace.guidance.packed_assemble import assemble_packed  # noqa: E402
from megatron_trace.guidance.records import assemble, pack_guidance, payload_of  # noqa: E402
from megatron_trace.guidance.site import FallbackCounter  # noqa: E402
from megatron_trace.megatron.context import StepGuidance  # noqa: E402
from megatron_trace.megatron.packing import pack_step  # noqa: E402


def stored(mode: str, long: int, short: int, n: int):
    """(columns of the long sample and of the short ones, trainer tokens [n, long], mask, sample lengths)."""
    dims, config, layers, sites, per_token = setup(mode)
    base = base_records(dims, config, sites, mode == "compact")
    parts, tok = [], torch.zeros(n, long, dtype=torch.int64)
    for ids, S in (([0], long), (list(range(1, n)), short)):
        t = tokens_of(len(ids), S) + ids[0]
        parts.append(pack_guidance(make_batch(dims, layers, sites, base, len(ids), S), t, version=0, sample_ids=ids))
        tok[ids[0]:ids[-1] + 1, :S] = t
    lengths = [long] + [short] * (n - 1)
    mask = torch.arange(long)[None] < torch.tensor(lengths)[:, None]
    return parts, tok, mask, lengths, per_token


def same(a: dict, b: dict) -> bool:
    def fields(sg):
        r = sg.record
        return [payload_of(r), r.block_scales.view(torch.uint8), r.global_amax, sg.valid, sg.expert_ids]

    return a.keys() == b.keys() and all(
        (x is None and y is None) or torch.equal(x, y) for k in a for x, y in zip(fields(a[k]), fields(b[k])))


def run(mode: str, long: int, short: int, n: int) -> dict:
    parts, tok, mask, lengths, per_token = stored(mode, long, short, n)
    padded = [-(-m // 8) * 8 for m in lengths]
    cu = [0]
    for p in padded:
        cu.append(cu[-1] + p)
    layout = PackedLayout.of(cu)
    ids = list(range(n))
    payload = per_token * sum(lengths)
    out = {"payload": payload, "bytes_per_token": per_token, "packed_tokens": cu[-1], "padded_tokens": n * long}
    samples = [s for p in parts for s in p.to_samples()]

    def padded_then_pack(fn, counter):
        def go():
            step = StepGuidance(sites=fn(counter), token_mask=mask)
            return pack_step(step, cu).sites
        return go

    def columns(counter, **kw):
        return assemble_packed(parts, ids, tok, versions=0, counter=counter, attention_mask=mask, **kw)

    def per_sample(counter, **kw):
        return assemble(samples, tok, versions=0, counter=counter, attention_mask=mask, **kw)

    for name, fn in (("columns", columns), ("samples", per_sample)):
        ca, cb = FallbackCounter(), FallbackCounter()
        a, m = measured(padded_then_pack(fn, ca))
        out[f"{name}_padded"] = {**m, "x": round(m["peak"] / payload, 2)}
        b, m = measured(lambda fn=fn, cb=cb: fn(cb, layout=layout))
        out[f"{name}_direct"] = {**m, "x": round(m["peak"] / payload, 2)}
        out[f"{name}_equal"] = same(a, b) and ca == cb  # tensors bit for bit, and the counts
        del a, b
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--long", type=int, default=8192)
    ap.add_argument("--short", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--modes", default="compact")
    a = ap.parse_args()
    if not 1 <= a.short <= a.long or a.samples < 2:
        ap.error(f"need 1 <= --short <= --long and --samples >= 2, got {a.short}, {a.long}, {a.samples}")
    malloc_returns_memory()
    torch.set_num_threads(1)
    res = {f"{mode}/1x{a.long}+{a.samples - 1}x{a.short}": run(mode, a.long, a.short, a.samples)
           for mode in a.modes.split(",")}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
