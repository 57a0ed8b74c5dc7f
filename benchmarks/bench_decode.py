"""End-to-end rollout decode throughput of the embedded (hf) backend: BF16 vs FP4 at a given context length.

The model is a Qwen3-MoE of ~2.1B parameters with random weights (default: hidden 2048, 12 layers, 32 experts
top-8, expert FFN 768, 16 query / 4 KV heads of 128, vocab 32000; ``--shape qwen3-30b-a3b``: that model's decoder
layer, 4 of them). Each point (mode, batch, context length L):

  1. the KV cache of every layer is filled with L random K/V rows (``cache.update``: FP4 mode quantizes them
     like a prefill would), instead of running a prefill forward;
  2. eager: ``steps`` decode steps of ``HFRolloutBackend.forward_context()`` (the backend's ``_step`` without
     the guidance recorder), timed end to end (host overhead included);
  3. graph: one decode step captured in a CUDA graph and replayed (the caches write in place, so a replay
     repeats the step at context ~L): the GPU time of a step, i.e. what an engine with CUDA graphs gets.

Modes: ``bf16`` = the backend's bf16 mode (experts: ``torch._grouped_mm``; KV: the same preallocated cache in
bf16); ``fp4f`` = TRACE numerics as the backend runs them by default (W4A4 emulation: activations quantized by the
Triton quantize kernel, expert weights read packed by the W4A16 grouped GEMM, FP4 KV cache quantized by Triton and
read by the fused FP4-KV decode attention's fast kernel, ``fast_kv_attention=True``); ``fp4`` = the same with that
attention's exact kernel (``fast_kv_attention=False``: K/V as the reference's bf16 values, several times slower at
long context); ``fp4u`` = ``fp4`` with the FP4 history dequantized to bf16, then SDPA. Each row records the
attention it ran (``fused_kv_attention``, ``fast_kv_attention``).
``--generate-batches``: also times ``HFRolloutBackend.generate`` (recorder included) on short prompts, and in FP4
modes without recording (``capture_share``: the part of the rollout time the guidance capture costs);
``--gen-prefill-wgmma`` and with ``experts.PREFILL_WGMMA`` on (prefill-sized expert GEMMs on the wgmma kernel);
``--gen-dense-off``: and with ``experts.DENSE_FROM`` None (prefill-sized expert GEMMs on the FP4 codes).
``--profile``: per point, the share of GPU time in attention (of which the KV update/dequantize and the
attention kernels) vs the MoE block (torch.profiler over eager steps), and ``--attn-micro`` a per-layer
attention micro-benchmark (bf16 SDPA, FP4 dequantize + SDPA, fused FP4 decode attention kernel).

Prints one JSON line per point (``--out`` appends them to a file too). ``--budget-s`` stops adding points
before the time runs out. ``--smoke``: a tiny model on the CPU (reference paths), a few seconds.
Plot: ``python benchmarks/plot_decode.py OUT.jsonl OUT.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import gc
import json
import logging
import pstats
import statistics
import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from megatron_trace.config import TraceConfig
from megatron_trace.rollout import HFRolloutBackend, SamplingParams, experts
from megatron_trace.rollout.kv_cache import FP4KVCache

logger = logging.getLogger("bench_decode")

MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
             num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=32,
             num_experts_per_tok=8)
# The Qwen3-30B-A3B decoder layer (32 query / 4 KV heads of 128, 128 experts top-8, expert FFN 768, hidden 2048)
# in a 4-layer model of ~2.6B parameters (vocab 32000 as above): at decode the expert weights a step reads are then
# the real model's share of each layer (at batch 8 about 50 of 128 experts active against 27 of 32 above).
SHAPES = {"default": MODEL, "qwen3-30b-a3b": dict(MODEL, num_hidden_layers=4, num_attention_heads=32,
                                                  num_experts=128)}
SMOKE_MODEL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                   num_experts_per_tok=2)


def model_config(dims: dict, max_len: int) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**dims, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=max_len, rope_theta=1e6, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


DECODE_MODES = ("bf16", "fp4f", "fp4", "fp4u")
"""This script's modes (``--modes``): fp4f, fp4 and fp4u differ in the decode loop's attention only."""
GENERATE_MODES = ("bf16", "fp4")
"""The modes of the benchmarks that time ``generate`` itself, where nothing tells fp4f or fp4u from fp4."""


def build_backends(cfg: Qwen3MoeConfig, modes, device, dtype, seed: int = 0, compile: bool | str = False,
                   static_decode: str = "off", known: tuple[str, ...] = DECODE_MODES) -> dict[str, HFRolloutBackend]:
    """One backend per numerics (bf16, fp4) over the same random weights (built on the device: fast init);
    ``fp4u`` shares the fp4 backend (only its cache differs). A mode not in ``known`` is refused before any model
    is built (any other name ran the bf16 backend, or an fp4 one, under that name)."""
    unknown = [m for m in modes if m not in known]
    if unknown or not modes:
        raise ValueError(f"modes {list(modes)}: {unknown or 'none given'}; each must be one of {known}")
    torch.manual_seed(seed)
    with torch.device(device):
        base = Qwen3MoeForCausalLM(cfg).to(dtype).eval()
    kinds = sorted({"fp4" if m.startswith("fp4") else "bf16" for m in modes})
    built = {}
    for i, kind in enumerate(kinds):
        model = base if i == len(kinds) - 1 else copy.deepcopy(base)
        built[kind] = HFRolloutBackend(model, mode=kind, trace_config=TraceConfig(), dtype=dtype, device=device,
                                       compile=compile, static_decode=static_decode)
    return {m: built["fp4" if m.startswith("fp4") else "bf16"] for m in modes}


def generate_parser(doc: str, *, batch: int, prompt: int, tokens: int) -> argparse.ArgumentParser:
    """The generate benchmarks' common options (modes, batch, prompt, new tokens, --smoke), with these defaults."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--modes", default="bf16,fp4")
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--prompt", type=int, default=prompt)
    p.add_argument("--tokens", type=int, default=tokens)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    return p


def backends_of(a: argparse.Namespace, **kwargs) -> dict[str, HFRolloutBackend]:
    """``build_backends`` for ``generate_parser``'s options: the benchmark model on the GPU in bf16 (``--smoke``: the
    tiny one on the CPU in fp32), room for the prompt and the new tokens; ``kwargs`` to ``build_backends``."""
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = model_config(dict(SMOKE_MODEL if a.smoke else MODEL), a.prompt + a.tokens + 64)
    return build_backends(cfg, a.modes.split(","), device, dtype, known=GENERATE_MODES, **kwargs)


def param_count(be: HFRolloutBackend) -> int:
    return sum(p.numel() for p in be.model.parameters())


class _ProfiledCache(FP4KVCache):
    """The benchmark's cache: labels each layer's KV update for the profiler."""

    @torch.compiler.disable  # as FP4KVCache.update: eager inside compiled layers
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        with torch.profiler.record_function("kv_update"):
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def new_cache(be: HFRolloutBackend, mode: str, profiled: bool = False, interval_masks: bool = False) -> FP4KVCache:
    """fp4: the backend's FP4 KV cache (fused decode attention where the backend uses it) with its exact kernel;
    fp4f: the same with the fast kernel (``fast_kv_attention``, the backend's default); fp4u: the same without the
    fused read (dequantize the history, then SDPA); bf16: the same preallocated cache with nothing quantized.
    ``interval_masks``: as ``generate``'s cache (``--masks interval``)."""
    fp4 = mode.startswith("fp4")
    cls = _ProfiledCache if profiled else FP4KVCache
    return cls(be.num_layers, be.config.activation_quantizer(), quantize_k=fp4 and be._quantizes("kv_k"),
               quantize_v=fp4 and be._quantizes("kv_v"), bf16_layers=be.bf16_kv_layers, kernel=be.config.kernel,
               fused_decode=mode in ("fp4", "fp4f") and be.fused_kv_attention, fast_attention=mode == "fp4f",
               interval_masks=interval_masks)


def fill_cache(be: HFRolloutBackend, cache, batch: int, length: int, gen: torch.Generator) -> None:
    """Write ``length`` random K/V rows ([B, kv_heads, L, head_dim], ~N(0,1) like normed keys) per layer."""
    c = be.hf_config
    shape = (batch, c.num_key_value_heads, length, c.head_dim)
    for layer in range(be.num_layers):
        k = torch.randn(shape, generator=gen, device=be.device, dtype=torch.float32).to(be.model.dtype)
        v = torch.randn(shape, generator=gen, device=be.device, dtype=torch.float32).to(be.model.dtype)
        cache.update(k, v, layer)
        del k, v


def decode_step(be: HFRolloutBackend, model, cache, tok, pos, pad=None):
    """One decode step of the backend (``HFRolloutBackend._step`` minus the recorder): logits [B, V]. ``pad``
    (int [B]): each row's left padding, passed as the attention mask (``--left-pad``); None: no mask."""
    mask = None
    if pad is not None:
        mask = (torch.arange(cache.get_seq_length() + 1, device=pad.device) >= pad[:, None]).long()
    out = model(input_ids=tok, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                **be.cache_kwargs(cache))
    return out.logits[:, -1]


def random_prompts(be: HFRolloutBackend, batch: int, prompt: int) -> list[list[int]]:
    """``batch`` prompts of ``prompt`` random token ids (seeded by ``batch``: the same prompts in every script)."""
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(3, be.vocab_size, (prompt,), generator=g).tolist() for _ in range(batch)]


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def generate_walls(be: HFRolloutBackend, prompts, sp, reps: int) -> list[float]:
    """Seconds of ``reps`` ``be.generate(prompts, sp)`` calls, synced, after one untimed warm-up (every kernel
    variant compiled)."""
    be.generate(prompts, sp)
    walls = []
    for _ in range(reps):
        _sync(be.device)
        t0 = time.perf_counter()
        be.generate(prompts, sp)
        _sync(be.device)
        walls.append(time.perf_counter() - t0)
    return walls


def profiled_generate(be: HFRolloutBackend, prompts, sp) -> tuple[float, pstats.Stats]:
    """One ``be.generate(prompts, sp)`` under cProfile, synced before and after: (seconds, its stats)."""
    prof = cProfile.Profile()
    _sync(be.device)
    t0 = time.perf_counter()
    prof.enable()
    be.generate(prompts, sp)
    _sync(be.device)
    prof.disable()
    return time.perf_counter() - t0, pstats.Stats(prof)


def time_eager(be, model, cache, tok, pos, warmup: int, steps: int, pad=None) -> float:
    """Seconds per decode step, host loop included (argmax feeds the next token: no host sync inside)."""
    dev = be.device
    for _ in range(warmup):
        tok = decode_step(be, model, cache, tok, pos, pad).argmax(-1, keepdim=True)
        pos = pos + 1
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = decode_step(be, model, cache, tok, pos, pad).argmax(-1, keepdim=True)
        pos = pos + 1
    _sync(dev)
    return (time.perf_counter() - t0) / steps


def time_graph(be, model, cache, tok, pos, reps: int) -> float:
    """Seconds per replay of one decode step captured in a CUDA graph (median of ``reps``)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up off the capture stream (Triton compiles, cuBLAS workspaces)
            decode_step(be, model, cache, tok, pos)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        decode_step(be, model, cache, tok, pos)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del g
    times.sort()
    return times[len(times) // 2]


def _annotate(model):
    """Forward hooks that open/close profiler ranges around each layer's attention and MoE block."""
    handles = []
    for layer in model.model.layers:
        for name, mod in (("attention", layer.self_attn), ("moe", layer.mlp)):
            stack = []

            def pre(m, args, name=name, stack=stack):
                stack.append(torch.profiler.record_function(name))
                stack[-1].__enter__()

            def post(m, args, out, stack=stack):
                stack.pop().__exit__(None, None, None)

            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return handles


ATTN_KERNELS = ("flash", "fmha", "attention", "sdpa", "fp4kv_decode_attn")
LABELS = ("decode_step", "attention", "moe", "kv_update")


def _gpu_shares(events) -> tuple[dict, dict, dict, str]:
    """(ms per label, ms per kernel name, launches per kernel name, method): each GPU kernel counts for every label
    whose GPU-side annotation span (first to last kernel launched inside the range) contains its start; idle gaps
    never count.
    Falls back to the CPU ranges' linked kernel time when the trace has no GPU annotations."""
    from bisect import bisect_right

    from torch.autograd import DeviceType

    spans = {k: [] for k in LABELS}
    kernels = []
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        if e.name in LABELS:
            spans[e.name].append((e.time_range.start, e.time_range.end))
        else:
            kernels.append((e.time_range.start, e.time_range.elapsed_us(), e.name))
    per_kernel, counts = {}, {}
    for _, dur, name in kernels:
        per_kernel[name] = per_kernel.get(name, 0.0) + dur
        counts[name] = counts.get(name, 0) + 1
    ranges = dict.fromkeys(LABELS, 0.0)
    if spans["attention"] and spans["moe"]:
        for label, iv in spans.items():
            iv.sort()
            starts = [a for a, _ in iv]
            for t, dur, _ in kernels:
                i = bisect_right(starts, t) - 1
                if i >= 0 and t <= iv[i][1]:
                    ranges[label] += dur
        return ranges, per_kernel, counts, "gpu_annotations"
    for e in events:  # CPU ranges with the kernels linked to the ops inside them
        if e.device_type == DeviceType.CPU and e.name in LABELS:
            ranges[e.name] += e.device_time_total
    return ranges, per_kernel, counts, "cpu_linked"


def profile_step(be, model, cache, tok, pos, steps: int, top_n: int = 12, pad=None) -> dict:
    """Share of a decode step's GPU time (CPU time on a CPU run) in attention, its KV update, and the MoE block."""
    from torch.profiler import ProfilerActivity, profile

    cuda = be.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    handles = _annotate(model)
    try:
        with profile(activities=acts) as prof:
            for _ in range(steps):
                with torch.profiler.record_function("decode_step"):
                    tok = decode_step(be, model, cache, tok, pos, pad).argmax(-1, keepdim=True)
                pos = pos + 1
            _sync(be.device)
    finally:
        for h in handles:
            h.remove()
    events = prof.events()
    if cuda:
        ranges, per_kernel, counts, method = _gpu_shares(events)
        step_ms = sum(per_kernel.values()) / steps / 1e3
    else:
        ranges = dict.fromkeys(LABELS, 0.0)
        for e in events:
            if e.name in LABELS:
                ranges[e.name] += e.cpu_time_total
        per_kernel, counts, method = {}, {}, "cpu_time"
        step_ms = ranges["decode_step"] / steps / 1e3
    ms = {k: v / steps / 1e3 for k, v in ranges.items()}
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    attn_kernels = sum(v for k, v in per_kernel.items() if any(a in k.lower() for a in ATTN_KERNELS)) / steps / 1e3
    step = step_ms or 1e-9
    res = {"step_ms": round(step_ms, 4), "method": method}
    for k in ("attention", "moe", "kv_update"):
        res[f"{k}_ms"] = round(ms[k], 4)
        res[f"{k}_share"] = round(ms[k] / step, 4)
    res["attn_kernels_ms"] = round(attn_kernels, 4)
    res["attn_kernels_share"] = round(attn_kernels / step, 4)
    res["other_share"] = round(1 - (ms["attention"] + ms["moe"]) / step, 4)
    res["top_kernels"] = [[k[:90], round(v / steps / 1e3, 4)] for k, v in top[:top_n]]
    if counts:
        res["kernels_per_step"] = round(sum(counts.values()) / steps, 1)
    return res


_GRAPH_FAILED: set[str] = set()


SDPA_BACKENDS = ("default", "flash", "efficient", "cudnn", "math")


def _sdpa_backend(name: str):
    """``torch.nn.attention.sdpa_kernel`` of one SDPA backend (``--sdpa-backend``: BF16's attention and FP4's
    prefill), or nothing for "default" (PyTorch's choice)."""
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name])


def measure_point(be, mode, batch, length, args, gen) -> dict:
    dev = be.device
    compiled = ("layers" if be.layers_compiled else "modules") if be.compiled_modules else False
    row = {"bench": "decode", "mode": mode, "batch": batch, "context": length, "compiled": compiled}
    if args.sdpa_backend != "default":
        row["sdpa_backend"] = args.sdpa_backend
    pad = None
    if args.left_pad:  # rows padded from 0 to left_pad x L, evenly
        pad = (torch.arange(batch, device=dev) * (args.left_pad * length / max(batch - 1, 1))).long()
        row.update(left_pad=args.left_pad, masks=args.masks)
    cache = new_cache(be, mode, profiled=args.profile, interval_masks=args.masks == "interval")
    try:
        fill_cache(be, cache, batch, length, gen)
        tok = torch.randint(3, be.vocab_size, (batch, 1), generator=gen, device=dev)
        pos = torch.full((batch, 1), length, dtype=torch.long, device=dev)
        with be.forward_context() as model, _sdpa_backend(args.sdpa_backend):
            eager = time_eager(be, model, cache, tok, pos, args.warmup, args.steps, pad)
            row["eager_ms"] = round(eager * 1e3, 3)
            row["eager_tok_s"] = round(batch / eager, 1)
            if args.profile:
                row["profile"] = profile_step(be, model, cache, tok, pos + args.warmup + args.steps, args.profile_steps,
                                              args.profile_top, pad)
                if be.layers_compiled:  # the attention / MoE ranges come from module hooks, which dynamo traces away
                    row["profile"] = {k: v for k, v in row["profile"].items()
                                      if not k.startswith(("attention_", "moe_", "kv_update_", "other_"))}
                    row["profile"]["shares"] = "n/a: compiled layers (step time and kernels only)"
            if dev.type == "cuda" and not args.no_graph and pad is None and mode not in _GRAPH_FAILED:
                try:
                    graph = time_graph(be, model, cache, tok, pos, args.graph_reps)
                    row["graph_ms"] = round(graph * 1e3, 3)
                    row["graph_tok_s"] = round(batch / graph, 1)
                except Exception as e:  # noqa: BLE001 - a failed capture is reported, the eager number stands
                    logger.exception("CUDA graph capture failed for %s; no more captures in this mode", mode)
                    _GRAPH_FAILED.add(mode)
                    row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
                    torch.cuda.synchronize()
        row["kv_bytes"] = cache.nbytes()
        row["fused_kv_attention"] = bool(cache.layers[0].fused_decode)
        row["fast_kv_attention"] = row["fused_kv_attention"] and bool(cache.layers[0].fast_attention)
    finally:
        del cache
        if dev.type == "cuda":
            row["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
    return row


def measure_generate(be, mode, batch, args) -> dict:
    """``HFRolloutBackend.generate`` (recorder, sampling, assembly included) on random prompts; in FP4 modes
    also without guidance recording (``set_guided_layers([])``), interleaved over ``--gen-reps`` rounds:
    ``capture_share`` = the median over rounds of the share of the generate time that capturing costs.
    ``--profile-generate``: also the host functions (cProfile) that take the most extra time when capturing."""
    prompts = random_prompts(be, batch, args.gen_prompt)
    sp = SamplingParams(max_new_tokens=args.gen_tokens, seed=0, stop_token_ids=())
    fused, fast, guided = be.fused_kv_attention, be.fast_kv_attention, sorted(be._guided_layer_ids)
    prefill_wgmma, dense_from = experts.PREFILL_WGMMA, experts.DENSE_FROM
    be.fused_kv_attention = fused and mode != "fp4u"
    be.fast_kv_attention = mode != "fp4"  # (generate's caches take the backend's flags)

    def timed(capture, prof=None):  # capture: True, False, "wgmma" (True with experts.PREFILL_WGMMA on) or
        be.set_guided_layers(guided if capture else [])  # "dense_off" (True with experts.DENSE_FROM None)
        experts.PREFILL_WGMMA = capture == "wgmma"
        experts.DENSE_FROM = None if capture == "dense_off" else dense_from
        _sync(be.device)
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        out = be.generate(prompts, sp)
        _sync(be.device)
        sec = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        return sec, out

    try:
        sites = len(be.guided_sites)
        captures = [True, False] if sites else [True]
        if args.gen_prefill_wgmma and mode != "bf16":
            captures.append("wgmma")
        if args.gen_dense_off and mode != "bf16":
            captures.append("dense_off")
        for c in captures:  # warm-up at full length, both ways: Triton compiles no kernel variant in a timed call
            timed(c)
        secs: dict = {c: [] for c in captures}
        manual = args.gen_gc == "manual"
        if manual:  # like Megatron-LM's --manual-gc: no collection inside a timed generate
            gc.collect()
            gc.freeze()
            gc.disable()
        try:
            for _ in range(args.gen_reps):
                for c in captures:
                    sec, out = timed(c)
                    secs[c].append(sec)
                    if manual:
                        gc.collect()
        finally:
            if manual:
                gc.enable()
                gc.unfreeze()
        sec = statistics.median(secs[True])
        row = {"bench": "decode_generate", "mode": mode, "batch": batch, "prompt": args.gen_prompt,
               "new_tokens": args.gen_tokens, "reps": args.gen_reps, "gc": args.gen_gc, "sec": round(sec, 3),
               "tok_s": round(int(out.response_lens.sum()) / sec, 1), "guided_sites": sites,
               "secs": [round(v, 3) for v in secs[True]]}
        if mode != "bf16":  # (a BF16 cache holds no FP4 K/V: the flags would say nothing about it)
            row.update(fused_kv_attention=be.fused_kv_attention,
                       fast_kv_attention=be.fused_kv_attention and be.fast_kv_attention)
        if False in secs:
            shares = [(a - b) / a for a, b in zip(secs[True], secs[False])]
            row.update(sec_no_capture=round(statistics.median(secs[False]), 3),
                       capture_share=round(statistics.median(shares), 3),
                       capture_share_of_min=round(1 - min(secs[False]) / min(secs[True]), 3),
                       capture_shares=[round(v, 3) for v in shares], secs_no_capture=[round(v, 3) for v in secs[False]])
            if args.profile_generate:
                row["capture_hot"] = _capture_hot(timed)
        if "wgmma" in secs:
            row.update(sec_prefill_wgmma=round(statistics.median(secs["wgmma"]), 3),
                       prefill_wgmma_speedup=round(sec / statistics.median(secs["wgmma"]), 3),
                       secs_prefill_wgmma=[round(v, 3) for v in secs["wgmma"]])
        if "dense_off" in secs:
            row.update(sec_dense_off=round(statistics.median(secs["dense_off"]), 3),
                       dense_speedup=round(statistics.median(secs["dense_off"]) / sec, 3),
                       secs_dense_off=[round(v, 3) for v in secs["dense_off"]])
    finally:
        be.fused_kv_attention, be.fast_kv_attention = fused, fast
        be.set_guided_layers(guided)
        experts.PREFILL_WGMMA = prefill_wgmma
        experts.DENSE_FROM = dense_from
    return row


def _capture_hot(timed, top: int = 25) -> list:
    """cProfile of one generate with and one without capture: the functions whose own time grew most."""
    import cProfile
    import pstats

    own = {}
    for c in (True, False):
        prof = cProfile.Profile()
        timed(c, prof)
        own[c] = {f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}": (v[1], v[2]) for k, v in pstats.Stats(prof).stats.items()}
    diff = {k: (v[1] - own[False].get(k, (0, 0.0))[1], v[0] - own[False].get(k, (0, 0.0))[0])
            for k, v in own[True].items()}
    hot = sorted(diff.items(), key=lambda kv: -kv[1][0])[:top]
    return [[k, round(dt * 1e3, 2), dn] for k, (dt, dn) in hot]


def emit(row: dict, out) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, a few seconds")
    p.add_argument("--modes", default="bf16,fp4f,fp4,fp4u",
                   help="bf16 | fp4f (the backend's default: the fused FP4-KV attention's fast kernel where available) "
                   "| fp4 (its exact kernel) | fp4u (FP4 KV dequantized, then SDPA)")
    p.add_argument("--batches", default=None, help="in order of priority, default 64,8,1,32 (smoke: 1,2)")
    p.add_argument("--lengths", default=None, help="context lengths, default 1024,8192,32768 (smoke: 16,48)")
    p.add_argument("--steps", type=int, default=8, help="timed eager decode steps per point")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--graph-reps", type=int, default=20)
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--profile", action="store_true", help="GPU-time shares: attention / KV update / MoE")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--profile-top", type=int, default=12, help="how many kernels the profile lists")
    p.add_argument("--compile", nargs="?", const="modules", default=None, choices=("modules", "layers"),
                   help="HFRolloutBackend(compile=...): modules (RMSNorms, routers; the default of a bare --compile) "
                   "or layers (whole decoder layers), see rollout.compiled")
    p.add_argument("--left-pad", type=float, default=0.0,
                   help="pass an attention mask: row i of B left-padded by i / (B-1) x this x L tokens (no graph: "
                        "transformers' SDPA mask reads it back to the host)")
    p.add_argument("--masks", choices=("words", "interval"), default="interval",
                   help="with --left-pad: the fused attention reads the mask (words) or each row's interval")
    p.add_argument("--sdpa-backend", choices=SDPA_BACKENDS, default="default",
                   help="the only SDPA backend allowed in the timed decode steps (BF16's attention)")
    p.add_argument("--static-decode", choices=("auto", "off", "eager", "graph"), default="auto",
                   help="HFRolloutBackend(static_decode=...): generate's decode steps on fixed buffers (graph: "
                        "replayed as a CUDA graph; auto, the backend's default: graph on CUDA; --generate-batches "
                        "times them; the per-point steps above are this script's own loop)")
    p.add_argument("--gemm-mean-config", action="store_true",
                   help="the W4A16 GEMM's config for the mean tokens per expert (moe_triton.BUSIEST_EXPERT off)")
    p.add_argument("--attn-micro", action="store_true", help="per-layer attention micro-benchmark too")
    p.add_argument("--generate-batches", default="", help="also time generate() at these batches")
    p.add_argument("--gen-prompt", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--gen-reps", type=int, default=3, help="interleaved rounds of generate with/without capture")
    p.add_argument("--gen-gc", choices=("auto", "manual"), default="auto",
                   help="manual: Python's GC frozen and disabled inside the timed generate calls, collected between")
    p.add_argument("--profile-generate", action="store_true", help="cProfile: where capture's host time goes")
    p.add_argument("--gen-prefill-wgmma", action="store_true",
                   help="FP4 modes: also time generate with experts.PREFILL_WGMMA on (sec_prefill_wgmma)")
    p.add_argument("--gen-dense-off", action="store_true",
                   help="FP4 modes: also time generate with experts.DENSE_FROM None, the expert GEMMs on the FP4 "
                        "codes at every size (sec_dense_off; dense_speedup: sec_dense_off / sec)")
    p.add_argument("--budget-s", type=float, default=0.0, help="stop adding points after this many seconds")
    p.add_argument("--out", default=None, help="append JSON lines to this file")
    p.add_argument("--shape", choices=tuple(SHAPES), default="default",
                   help="model dims: default (above) or qwen3-30b-a3b (its decoder layer, 4 layers)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--device", default=None)
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    dims = dict(SMOKE_MODEL if args.smoke else SHAPES[args.shape])
    args.batches = args.batches or ("1,2" if args.smoke else "64,8,1,32")
    args.lengths = args.lengths or ("16,48" if args.smoke else "1024,8192,32768")
    if args.smoke:
        args.steps, args.warmup, args.profile_steps = min(args.steps, 2), min(args.warmup, 1), 1
    if args.layers:
        dims["num_hidden_layers"] = args.layers
    if args.experts:
        dims["num_experts"] = args.experts
    if args.gemm_mean_config:
        from megatron_trace.kernels import moe_triton

        moe_triton.BUSIEST_EXPERT = False
    device = torch.device(args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    modes = args.modes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    lengths = [int(v) for v in args.lengths.split(",")]
    out = open(args.out, "a") if args.out else None
    rows = []
    try:
        t0 = time.perf_counter()
        cfg = model_config(dims, max(lengths) + 1024)
        backends = build_backends(cfg, modes, device, dtype, compile=args.compile or False,
                                  static_decode=args.static_decode)
        be0 = next(iter(backends.values()))
        head = {"bench": "decode_setup", "device": str(device), "dtype": str(dtype), "model": dims,
                "compile": args.compile, "gemm_mean_config": args.gemm_mean_config,
                "static_decode": args.static_decode,
                "params": param_count(be0), "setup_s": round(time.perf_counter() - t0, 2)}
        if device.type == "cuda":
            head["gpu"] = torch.cuda.get_device_name(device)
            import triton

            head["torch"], head["triton"] = torch.__version__, triton.__version__
        emit(head, out)
        rows.append(head)
        if args.attn_micro and device.type == "cuda":
            from bench_decode_attn import attention_micro

            micro = list(attention_micro(be0.hf_config, batches, lengths, device, budget_left=_budget(args, t_start)))
            for row in micro:
                emit(row, out)
                rows.append(row)
            row = tune_attention(micro)
            emit(row, out)
            rows.append(row)
        last = 0.0
        for batch in batches:  # batch outer: every context length of the first batches before the last batch
            for length in lengths:
                for mode in modes:
                    left = _budget(args, t_start)
                    if left is not None and left < 1.5 * last:
                        emit({"bench": "decode_skipped", "mode": mode, "batch": batch, "context": length,
                              "reason": f"budget: {left:.1f} s left, last point took {last:.1f} s"}, out)
                        continue
                    t1 = time.perf_counter()
                    try:
                        # every mode of a point gets the same K/V history and first tokens
                        gen = torch.Generator(device=device).manual_seed(batch * 100003 + length)
                        row = measure_point(backends[mode], mode, batch, length, args, gen)
                    except Exception as e:  # noqa: BLE001 - one failed point (OOM, a kernel error) must not lose the rest
                        logger.exception("point %s B=%d L=%d failed", mode, batch, length)
                        row = {"bench": "decode", "mode": mode, "batch": batch, "context": length,
                               "error": f"{type(e).__name__}: {str(e)[:300]}"}
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    row["wall_s"] = round(time.perf_counter() - t1, 2)
                    last = max(last * 0.5, row["wall_s"])
                    emit(row, out)
                    rows.append(row)
        for batch in [int(b) for b in args.generate_batches.split(",") if b]:
            for mode in modes:
                left = _budget(args, t_start)
                if left is not None and left < 10:
                    break
                try:
                    row = measure_generate(backends[mode], mode, batch, args)
                except Exception as e:  # noqa: BLE001
                    logger.exception("generate %s B=%d failed", mode, batch)
                    row = {"bench": "decode_generate", "mode": mode, "batch": batch,
                           "error": f"{type(e).__name__}: {str(e)[:300]}"}
                emit(row, out)
                rows.append(row)
        emit(summary(rows), out)
    finally:
        if out is not None:
            out.close()
    return rows


ATTN_VARIANTS = {"fused": (64, 4), "fused_w8": (64, 8), "fused_bt32": (32, 4)}  # (block_t, num_warps)


def tune_attention(micro: list[dict]) -> dict:
    """Pick the fused attention's (block_t, num_warps) with the least total micro-benchmark time (exact numerics
    in every variant) for the decode points that follow."""
    from megatron_trace.kernels import kv_attention_triton

    ok = [r for r in micro if r.get("bench") == "decode_attn" and "error" not in r]
    totals = {v: sum(r[f"{v}_us"] for r in ok) for v in ATTN_VARIANTS} if ok else {}
    best = min(totals, key=totals.get) if totals else "fused"
    kv_attention_triton.BLOCK_T, kv_attention_triton.NUM_WARPS = ATTN_VARIANTS[best]
    return {"bench": "decode_attn_config", "variant": best, "block_t": ATTN_VARIANTS[best][0],
            "num_warps": ATTN_VARIANTS[best][1], "total_us": {k: round(v, 1) for k, v in totals.items()}}


def _budget(args, t_start) -> float | None:
    return None if not args.budget_s else args.budget_s - (time.perf_counter() - t_start)


def summary(rows: list[dict]) -> dict:
    """FP4 / BF16 tokens/s ratios per (batch, context), eager and graph, for each FP4 mode."""
    by = {(r["mode"], r["batch"], r["context"]): r for r in rows if r.get("bench") == "decode" and "error" not in r}
    ratios = []
    for (mode, b, length), r in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        base = by.get(("bf16", b, length))
        if mode == "bf16" or base is None:
            continue
        item = {"mode": mode, "batch": b, "context": length,
                "eager_x": round(r["eager_tok_s"] / base["eager_tok_s"], 3)}
        if "graph_tok_s" in r and "graph_tok_s" in base:
            item["graph_x"] = round(r["graph_tok_s"] / base["graph_tok_s"], 3)
        ratios.append(item)
    return {"bench": "decode_summary", "over_bf16": ratios}


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    with contextlib.suppress(BrokenPipeError):
        main()
