"""Host time of a rollout's eager steps by module: where FP4's host pass costs more than BF16's.

A decode step at small batch is host-bound: its GPU work (~3 ms at batch 8) is queued faster than the host walks
through the layers (~25-40 ms), so the host's time per module is the step's time. Forward pre/post hooks on every
module of ``HFRolloutBackend.model`` read ``time.perf_counter`` (no sync) and sum each module class's own time
(children excluded) per step: step 0 is the prefill, steps 1.. the eager fixed-buffer decode steps
(``static_decode="eager"``: the pass a graph generate runs eagerly before its capture, and the capture's own).
``Qwen3MoeExperts`` holds the rollout's experts forward (activation quantize, routing, GEMMs, combine, records);
``Qwen3MoeAttention``'s own time the rotary, the KV cache update and the attention call. Per mode one JSON line:
the generate's wall (median of ``--reps``), the prefill's and the median decode step's host ms, and own ms per
module class in each (``--timed N``: N generates timed, the median prefill's figures and its generate's steps).
``--pieces``: also host us per call of layer 0's pieces at the decode batch (looped, no sync:
the experts module, its activation quantize + record, routing, GEMM and combine, the K+V token write of a static
cache and the decode attention), and ``--cprofile`` the functions with the most own time in the named pieces.
Usage (H200, carry .whl):
    python3 benchmarks/profile_step_host.py [--modes bf16,fp4] [--batch 8] [--prompt 512] [--tokens 8] [--pieces]
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict

import torch
from _timing import host_us, profile_op
from bench_decode import backends_of, generate_parser, generate_walls, random_prompts

from megatron_trace.kernels import fp4_grouped_mm
from megatron_trace.kernels.kv_attention import dense_decode_attention, fp4kv_decode_attention
from megatron_trace.rollout import SamplingParams, experts, fp4_moe


class ModuleHostTimer:
    """Own host seconds per module class and per call of the root module (one step each), from forward hooks."""

    def __init__(self, model: torch.nn.Module):
        self.root, self.on = model, False
        self.stack: list[list] = []
        self.steps: list[dict[str, float]] = []
        self.handles = [h for m in model.modules()
                        for h in (m.register_forward_pre_hook(self._pre), m.register_forward_hook(self._post))]

    def _pre(self, module, args) -> None:
        if self.on:
            self.stack.append([type(module).__name__, time.perf_counter(), 0.0])
            if module is self.root:
                self.steps.append(defaultdict(float))

    def _post(self, module, args, out) -> None:
        if not self.on or not self.stack:
            return
        name, t0, children = self.stack.pop()
        dt = time.perf_counter() - t0
        step = self.steps[-1]
        step[name] += dt - children
        if self.stack:
            self.stack[-1][2] += dt
        else:
            step["(step)"] = dt

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _ms(step: dict[str, float]) -> dict[str, float]:
    return {k: round(v * 1e3, 3) for k, v in sorted(step.items(), key=lambda kv: -kv[1])}


def _median_of(steps: list[dict[str, float]]) -> dict[str, float]:
    return sorted(steps, key=lambda s: s["(step)"])[len(steps) // 2] if steps else {}


def run(be, mode: str, batch: int, prompt: int, tokens: int, reps: int, timed: int = 1) -> dict:
    """One JSON row of ``mode``: ``timed`` generates under the hook timer; the prefill's figures are the median
    prefill's (each generate's prefill host ms listed), the decode steps those of that generate."""
    if timed < 1:
        raise ValueError(f"timed={timed}: at least one generate must be timed")
    prompts = random_prompts(be, batch, prompt)
    sp = SamplingParams(max_new_tokens=tokens, seed=0, stop_token_ids=())
    walls = generate_walls(be, prompts, sp, reps)
    timer = ModuleHostTimer(be.model)
    timer.on = True
    runs = []
    for _ in range(timed):
        be.generate(prompts, sp)
        runs.append(timer.steps)
        timer.steps = []
    timer.on = False
    timer.remove()
    prefill = _median_of([r[0] for r in runs])
    decode = next(r for r in runs if r[0] is prefill)[1:]
    return {"bench": "step_host", "mode": mode, "batch": batch, "prompt": prompt, "new_tokens": tokens,
            "static_decode": be.static_decode, "generate_ms": round(statistics.median(walls) * 1e3, 1),
            "prefill_host_ms": round(prefill["(step)"] * 1e3, 2),
            "prefill_host_ms_runs": [round(r[0]["(step)"] * 1e3, 2) for r in runs],
            "decode_step_host_ms": [round(s["(step)"] * 1e3, 2) for s in decode],
            "prefill_own_ms": _ms(prefill), "decode_median_step_own_ms": _ms(_median_of(decode))}


def pieces(be, mode: str, batch: int, rows: int, calls: int, cprofile: tuple[str, ...] = ()) -> dict:
    """Host us per call of layer 0's decode pieces at ``batch`` tokens (a static cache of ``rows`` rows)."""
    dev, dt, c = be.device, be.model.dtype, be.hf_config
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(batch, c.hidden_size, device=dev, generator=g).to(dt)
    k = c.num_experts_per_tok
    idx = torch.randint(0, c.num_experts, (batch, k), device=dev, generator=g)
    w = torch.rand(batch, k, device=dev, generator=g).to(dt)
    mod = be.model.model.layers[0].mlp.experts
    q = be.config.activation_quantizer()
    order, offs, inv = fp4_moe._routing(idx, c.num_experts)
    fp4 = mode == "fp4"
    if fp4:
        fc1 = be.weight_store.stacked(0, experts.FC1)
        packed = be.weight_store.packed(0, experts.FC1, "mma")
        gemm = lambda: fp4_grouped_mm(h[order // k], fc1, offs, kernel="triton", packed=packed)  # noqa: E731
    else:
        gemm = lambda: fp4_moe._grouped_dense(h[order // k], mod.gate_up_proj, offs)  # noqa: E731
    y = torch.randn(batch * k, c.hidden_size, device=dev, generator=g).to(dt)
    cache = be.new_cache(None, interval_masks=True, static_rows=rows)
    kv = (batch, c.num_key_value_heads, rows - 16, c.head_dim)
    cache.update(torch.randn(kv, device=dev, dtype=dt), torch.randn(kv, device=dev, dtype=dt), 0)
    cache.decode_position().fill_(rows - 16)
    k1, v1 = (torch.randn(batch, c.num_key_value_heads, 1, c.head_dim, device=dev, dtype=dt) for _ in range(2))
    layer = cache.layers[0]
    qh = torch.randn(batch, c.num_attention_heads, c.head_dim, device=dev, dtype=dt)
    starts = torch.zeros(batch, dtype=torch.int32, device=dev)
    ends = torch.full((batch,), rows - 15, dtype=torch.int32, device=dev)

    def attention():
        kh, vh = layer.packed_history()
        attend = fp4kv_decode_attention if fp4 else dense_decode_attention
        extra = {"exact": not layer.fast_attention} if fp4 else {}
        return attend(qh, kh, vh, starts=starts, lengths=ends, readable_rows=layer.readable_rows(), **extra)

    out, prof = {}, {}
    with be.forward_context(None):
        cases = {"experts_module": lambda: mod(h, idx, w), "routing": lambda: fp4_moe._routing(idx, c.num_experts),
                 "gemm_fc1": gemm, "combine": lambda: fp4_moe._combine(y, inv, w, dt),
                 "kv_token_write": lambda: cache.update(k1, v1, 0), "decode_attention": attention,
                 "torch_add (reference point)": lambda: h.add(1)}
        if fp4:
            cases["act_quantize_record"] = lambda: fp4_moe._quantize_dequantize(h, q, record=True)
        for name, fn in cases.items():
            out[name] = round(host_us(fn, calls, "cuda", warmup=10), 1)
        for name in cprofile:
            prof[name] = profile_op(cases[name], calls)
    return {"bench": "step_host_pieces", "mode": mode, "batch": batch, "rows": rows, "host_us_per_call": out,
            "cprofile_own_us_per_call": prof}


def main(argv=None) -> None:
    p = generate_parser(__doc__, batch=8, prompt=512, tokens=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timed", type=int, default=1, help="generates under the hook timer (the prefill: their median)")
    p.add_argument("--static-decode", default="eager", choices=("eager", "off"))
    p.add_argument("--pieces", action="store_true", help="host us per call of layer 0's pieces (CUDA)")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--cprofile", default="", help="comma-separated pieces to cProfile (own us per call)")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    backends = backends_of(a, static_decode=a.static_decode)
    for m in modes:
        print(json.dumps(run(backends[m], m, a.batch, a.prompt, a.tokens, a.reps, a.timed)), flush=True)
    if a.pieces and torch.cuda.is_available() and not a.smoke:
        rows = -(-(a.prompt + 16) // 16) * 16
        for m in modes:
            named = tuple(n for n in a.cprofile.split(",") if n and (m == "fp4" or "quantize" not in n))
            print(json.dumps(pieces(backends[m], m, a.batch, rows, a.calls, named)), flush=True)


if __name__ == "__main__":
    main()
