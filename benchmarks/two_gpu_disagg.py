"""Disaggregated RL on two ranks: rank 0 rollout engine (hf, FP4), rank 1 Megatron trainer (issue 9, part 2).

    python3 benchmarks/two_gpu_disagg.py            # 2 CUDA devices ("cpu:gloo,cuda:nccl"; NCCL_NVLS_ENABLE=0)
    python3 benchmarks/two_gpu_disagg.py --smoke    # CPU, gloo, micro model (the CPU test runs this)
    bash benchmarks/device_two_gpu.sh              # device call (kind nvidia-h200-x2, carry .whl): both scripts

One real GRPO step across the two processes (the HF checkpoint is a short SFT warm-up made first):

1. rank 0 samples G responses per prompt with FP4 numerics and records the TRACE guidance (compact, the
   config's guided layers) and its expert choices; rewards and group advantages are computed there;
2. the batch goes to rank 1 (object send), the guidance and routing with ``GuidanceSync`` (timed; then
   re-sent ``--reps`` times and compared with a raw send/recv of the same byte count);
3. rank 1 assembles them (``GuidanceShard.assemble`` / ``assemble_routing``, from the received columns), runs
   the PPO-clip step under ``trace_guidance`` (routing replay + guided rounding) and an optimizer step;
4. the new weights go back to rank 0 over the process group, BF16 then FP4 (``fp4_stream``: packed
   routed experts), as ``WeightBucket`` buffers; rank 0 applies each with ``update_weights``.
   Checked: rank 0's stored FP4 expert codes equal the trainer's quantization of its new weights.

Prints one JSON line per rank and a summary line; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
for _k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):  # multicast stays off
    os.environ[_k] = "0" if _k == "NCCL_NVLS_ENABLE" else "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._ranks import emit, gather, record_errors, write_result  # noqa: E402

WORLD, ROLLOUT, TRAINER = 2, 0, 1
MODELS = {  # TinyMoEConfig kwargs: (full, smoke)
    False: dict(num_layers=8, hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                num_experts=32, top_k=4, moe_intermediate_size=256),
    True: dict(num_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
               num_experts=4, top_k=2, moe_intermediate_size=32),
}


def args_():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU/gloo, micro model")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--sft-steps", type=int, default=400, help="0: a random-init checkpoint (rewards ~0)")
    p.add_argument("--reps", type=int, default=5, help="timed re-sends of the guidance and the raw buffer")
    p.add_argument("--bucket-mb", type=float, default=256.0)
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--timeout", type=float, default=540.0)
    a = p.parse_args()
    if a.smoke:
        a.prompts, a.group, a.sft_steps, a.reps, a.bucket_mb = 4, 4, 0, 2, 0.05
    return a


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, reps: int) -> tuple[float, object]:
    """Median seconds of ``reps`` calls (both ranks start together), and the last result."""
    times, out = [], None
    for _ in range(reps):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


# ---- rollout rank -------------------------------------------------------------------------------------------
def rollout_rank(a, hf_dir, trace, device, sync) -> tuple[dict, list[str]]:
    from megatron_trace.guidance.records import split_batch
    from megatron_trace.guidance.routing import split_routing
    from megatron_trace.rl.grpo import group_advantages
    from megatron_trace.rl.tasks import CharTokenizer, get_task, response_rewards
    from megatron_trace.rollout.base import SamplingParams
    from megatron_trace.rollout.hf import HFRolloutBackend

    task, tok, fails = get_task("add"), CharTokenizer(), []
    rollout = HFRolloutBackend(hf_dir, mode="fp4", trace_config=trace, device=device)
    g = torch.Generator().manual_seed(0)
    problems = [p for p in (task.sample(g) for _ in range(a.prompts)) for _ in range(a.group)]
    t0 = time.perf_counter()
    batch = rollout.generate([tok.encode(p.prompt, bos=True) for p in problems],
                             SamplingParams(temperature=1.0, max_new_tokens=task.answer_len + 1,
                                            stop_token_ids=(tok.eos_id,), seed=0))
    _sync(device)
    t_roll = time.perf_counter() - t0
    rewards = torch.tensor(response_rewards(task, tok, problems, batch.responses()))
    mask = batch.attention_mask
    data = {"tokens": batch.tokens.cpu(), "mask": mask.cpu(), "response_mask": batch.response_mask.cpu(),
            "logprobs": batch.logprobs.cpu(), "advantages": group_advantages(rewards, a.group),
            "version": batch.policy_version}
    dist.send_object_list([data], dst=TRAINER)
    samples = split_batch(batch.guidance, batch.tokens, version=batch.policy_version, attention_mask=mask)
    routing = split_routing(batch.routing, batch.tokens, version=batch.policy_version,
                            num_experts=rollout.hf_config.num_experts, attention_mask=mask)
    t_first, _ = _timed(lambda: sync.send(samples, routing=routing), device, 1)  # the step's transfer
    t_sync, _ = _timed(lambda: sync.send(samples, routing=routing), device, a.reps)
    msgs = sync.encode(samples, routing)
    wire = sum(m.numel() * m.element_size() for m in msgs)
    dist.send_object_list([wire], dst=TRAINER)
    raw = torch.empty(wire, dtype=torch.uint8, device=sync.device)
    t_raw, _ = _timed(lambda: dist.send(raw, TRAINER, group=sync.group), device, a.reps)
    tokens = int(mask.sum())
    g_bytes = sum(s.guidance_nbytes() for s in samples)
    r_bytes = sum(r.nbytes() for r in routing)
    row = {"bench": "two_gpu_disagg", "rank": ROLLOUT, "role": "rollout", "device": str(device),
           "samples": len(samples), "tokens": tokens, "reward_mean": float(rewards.mean()),
           "rollout_s": t_roll, "guided_sites": len(batch.guidance),
           "guidance_bytes_per_step": g_bytes, "routing_bytes_per_step": r_bytes,
           "guidance_bytes_per_token": g_bytes / max(tokens, 1), "sync_wire_bytes": wire,
           "guidance_sync_first_s": t_first, "guidance_sync_s": t_sync, "raw_send_s": t_raw,
           "guidance_sync_GBps": wire / t_sync / 1e9, "raw_send_GBps": wire / t_raw / 1e9,
           "guidance_sync_vs_raw": t_raw / t_sync}
    old = {layer: rollout.expert_weight_fp4(layer, 0, "fc2").codes.cpu().clone() for layer in range(rollout.num_layers)}
    row.update(receive_weights(rollout, device))
    expected = [None]
    dist.recv_object_list(expected, src=TRAINER)
    changed = 0
    for (layer, e), codes in expected[0].items():
        got = rollout.expert_weight_fp4(layer, e, "fc2").codes.cpu()
        changed += not torch.equal(got, old[layer])
        if not torch.equal(got, codes):
            fails.append(f"rollout's FP4 codes of layer {layer} expert {e} fc2 != the trainer's quantization")
    row["fp4_codes_checked"], row["fp4_codes_changed_by_sync"] = len(expected[0]), changed
    if not a.smoke and changed == 0:  # the smoke model is untrained: rewards 0, no update to see
        fails.append("the weight sync changed no checked FP4 expert codes (did the trainer step update them?)")
    row["policy_version_after_sync"] = rollout.policy_version
    if rollout.policy_version != 2:
        fails.append(f"rollout policy_version {rollout.policy_version} != 2 after two syncs")
    return row, fails


def receive_weights(rollout, device) -> dict:
    """Buckets from the trainer (layout as an object, the buffer as a tensor), applied per format."""
    from megatron_trace.bridge.sync import WeightBucket

    out = {}
    for version, fmt in enumerate(("bf16", "fp4"), start=1):
        dist.barrier()
        _sync(device)
        t0, nbytes, values = time.perf_counter(), 0, []
        while True:
            head = [None]
            dist.recv_object_list(head, src=TRAINER)
            if head[0] is None:
                break
            buf = torch.empty(head[0]["nbytes"], dtype=torch.uint8, device=device)
            dist.recv(buf, TRAINER)
            values += WeightBucket(buf, head[0]["entries"]).values()
            nbytes += buf.numel()
        t_wire = time.perf_counter() - t0
        rollout.update_weights(values, version=version)
        _sync(device)
        out.update({f"weight_sync_{fmt}_bytes": nbytes, f"weight_sync_{fmt}_s": time.perf_counter() - t0,
                    f"weight_sync_{fmt}_wire_s": t_wire, f"weight_sync_{fmt}_tensors": len(values)})
    return out


# ---- trainer rank -------------------------------------------------------------------------------------------
def trainer_rank(a, hf_dir, trace, device, sync) -> tuple[dict, list[str]]:
    from megatron_trace.guidance.site import FallbackCounter
    from megatron_trace.megatron import StepGuidance, trace_guidance
    from megatron_trace.rl.grpo import policy_loss
    from megatron_trace.rl.trainer import MegatronPolicy

    fails = []
    policy = MegatronPolicy(hf_dir, trace, quantized=True, lr=1e-4, device=str(device))
    data = [None]
    dist.recv_object_list(data, src=ROLLOUT)
    data = {k: v.to(device) if torch.is_tensor(v) else v for k, v in data[0].items()}
    t_first, shard = _timed(sync.receive_shard, device, 1)
    t_sync, _ = _timed(sync.receive_shard, device, a.reps)
    wire = [None]
    dist.recv_object_list(wire, src=ROLLOUT)
    wire = wire[0]
    raw = torch.empty(wire, dtype=torch.uint8, device=sync.device)
    _timed(lambda: dist.recv(raw, ROLLOUT, group=sync.group), device, a.reps)
    tokens, mask, version = data["tokens"], data["mask"], data["version"]
    counter = FallbackCounter()
    ids = list(range(tokens.shape[0]))  # split_batch's default sample ids: row b of the rollout batch
    t0 = time.perf_counter()  # batch-major tensors straight from the received columns (no per-sample objects)
    sites = shard.assemble(ids, tokens, versions=version, counter=counter, attention_mask=mask)
    routing = shard.assemble_routing(ids, tokens, versions=version, attention_mask=mask)
    _sync(device)
    t_assemble = time.perf_counter() - t0
    step = StepGuidance(sites=sites, routing=routing, token_mask=mask)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    t0 = time.perf_counter()
    policy.optimizer.zero_grad()
    with trace_guidance(policy.model, step) as h:
        logp = policy.logprobs(tokens)
        loss, stats = policy_loss(logp, logp.detach(), data["logprobs"], data["advantages"], data["response_mask"],
                                  clip_eps=0.2, tis_cap=5.0)
        loss.backward()
    grad_norm = policy.optimizer.step()
    _sync(device)
    t_train = time.perf_counter() - t0
    rm = data["response_mask"]
    diff = ((logp.detach() - data["logprobs"]).abs() * rm).sum() / rm.sum().clamp_min(1)
    changed = sum(not torch.equal(p, before[n]) for n, p in policy.model.named_parameters())
    row = {"bench": "two_gpu_disagg", "rank": TRAINER, "role": "trainer", "device": str(device),
           "samples_received": shard.stats.samples, "routing_received": sum(len(p.table) for p in shard.routing_parts),
           "guidance_payload_bytes": shard.stats.payload_bytes, "guidance_peak_bytes": shard.stats.peak_bytes,
           "guidance_receive_first_s": t_first, "guidance_receive_s": t_sync, "guidance_assemble_s": t_assemble,
           "train_step_s": t_train,
           "loss": float(loss.detach()), "grad_norm": grad_norm, "logprob_abs_diff_vs_rollout": float(diff),
           "params_changed": changed, "advantages_nonzero": int((data["advantages"] != 0).sum()),
           "guided_coverage": h.coverage(), **counter.as_dict("guidance/assembly"),
           **h.counter.as_dict("guidance/trainer"), **{f"pg/{k}": v for k, v in stats.items()}}
    if counter.fallback or h.counter.used == 0 or h.coverage() < 1.0:
        fails.append(f"guidance not fully used: assembly {counter.as_dict()}, trainer {h.counter.as_dict()}")
    if bool((data["advantages"] != 0).any()) and changed == 0:
        fails.append("the optimizer step changed no parameter despite nonzero advantages")
    if not (torch.isfinite(loss) and grad_norm == grad_norm):
        fails.append(f"loss {float(loss)} / grad_norm {grad_norm} not finite")
    row.update(send_weights(policy, trace, device, a))
    q, expected = trace.weight_quantizer(), {}
    for name, w in policy.export_hf_weights():  # the trainer's own quantization of its new expert weights
        if name.endswith("experts.0.down_proj.weight"):
            expected[(int(name.split(".layers.")[1].split(".")[0]), 0)] = q.quantize(w.detach()).codes.cpu()
    dist.send_object_list([expected], dst=ROLLOUT)
    return row, fails


def send_weights(policy, trace, device, a) -> dict:
    """BF16 then FP4 sync: buckets of ``make_stream`` packed on the device, sent to the rollout rank."""
    from megatron_trace.bridge.sync import WeightBucket, iter_buckets, make_stream

    out = {}
    for fmt in ("bf16", "fp4"):
        dist.barrier()
        _sync(device)
        t0, nbytes, n = time.perf_counter(), 0, 0
        stream = make_stream(policy.export_hf_weights(), fmt, trace.weight_quantizer())
        for items in iter_buckets(stream, max(1, int(a.bucket_mb * 2**20))):
            bucket = WeightBucket.pack(items, device)
            dist.send_object_list([{"nbytes": bucket.nbytes, "entries": bucket.entries}], dst=ROLLOUT)
            dist.send(bucket.buffer, ROLLOUT)
            nbytes, n = nbytes + bucket.nbytes, n + 1
        dist.send_object_list([None], dst=ROLLOUT)
        _sync(device)
        out.update({f"weight_send_{fmt}_bytes": nbytes, f"weight_send_{fmt}_s": time.perf_counter() - t0,
                    f"weight_send_{fmt}_buckets": n})
    return out


# ---- processes ----------------------------------------------------------------------------------------------
def worker(rank: int, port: int, a, hf_dir: str, tmp: str) -> None:
    with record_errors(tmp, rank):
        from megatron.core import parallel_state

        from megatron_trace.config import TraceConfig
        from megatron_trace.guidance.sync import GuidanceSync
        from megatron_trace.testing.megatron_cpu import apply_cpu_shims, fix_router_without_te

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if a.smoke:
            torch.set_num_threads(1)
            apply_cpu_shims()
            device = torch.device("cpu")
            dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=a.timeout))
        else:
            fix_router_without_te()
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=WORLD,
                                    timeout=timedelta(seconds=a.timeout))  # mbridge scatters CPU tensors
        parallel_state.initialize_model_parallel()  # collective: both ranks (the trainer's groups are size 1)
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
        trace = TraceConfig()  # the default TRACE arm: compact records, the config's guided layers
        sync = GuidanceSync(ROLLOUT, [TRAINER], timeout=timedelta(seconds=a.timeout))
        fn = rollout_rank if rank == ROLLOUT else trainer_rank
        row, fails = fn(a, hf_dir, trace, device, sync)
        write_result(tmp, rank, [row], fails)
        dist.barrier()
        sync.close()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def summary(rows: list[dict]) -> dict:
    by = {r["role"]: r for r in rows}
    r, t = by.get("rollout", {}), by.get("trainer", {})
    out = {k: r.get(k) for k in ("guidance_bytes_per_step", "routing_bytes_per_step", "guidance_bytes_per_token",
                                 "guidance_sync_GBps", "raw_send_GBps", "guidance_sync_vs_raw")}
    for fmt in ("bf16", "fp4"):
        out[f"weight_sync_{fmt}_bytes"] = r.get(f"weight_sync_{fmt}_bytes")
        out[f"weight_sync_{fmt}_s"] = r.get(f"weight_sync_{fmt}_s")
    if r.get("weight_sync_fp4_bytes"):
        out["weight_sync_bf16_over_fp4_bytes"] = r["weight_sync_bf16_bytes"] / r["weight_sync_fp4_bytes"]
    out["train_step_s"] = t.get("train_step_s")
    return out


def checkpoint(a, path: str) -> str:
    """The HF checkpoint both ranks start from: the demo's SFT warm-up, or a random init (``--sft-steps 0``)."""
    from megatron_trace.rl.sft import SFTConfig, TinyMoEConfig, sft_checkpoint
    from megatron_trace.rl.tasks import CharTokenizer, get_task

    model = TinyMoEConfig(**MODELS[a.smoke])
    if a.sft_steps:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        return str(sft_checkpoint(path, get_task("add"), model, SFTConfig(steps=a.sft_steps, batch_size=128),
                                 device=dev))
    from transformers import Qwen3MoeForCausalLM

    tok = CharTokenizer()
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(model.hf_config(tok.vocab_size, tok)).save_pretrained(path)
    return path


def main() -> int:
    from megatron_trace.testing.megatron_cpu import free_port, spawn_ranks

    a = args_()
    if not a.smoke and torch.cuda.device_count() < WORLD:
        print(json.dumps({"bench": "two_gpu_disagg", "skipped": f"needs {WORLD} CUDA devices (or --smoke)"}))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = checkpoint(a, os.path.join(tmp, "sft"))
        port = free_port()
        codes = spawn_ranks(worker, WORLD, lambda r: (r, port, a, hf_dir, tmp), timeout=a.timeout)
        rows, fails = gather(tmp, WORLD, codes)
    rows.append({"bench": "two_gpu_disagg", "summary": True, "ok": not fails, "fails": fails, **summary(rows)})
    emit(rows, a.out)
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
