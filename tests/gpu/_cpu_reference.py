"""The CPU reference of the GPU test, run in a subprocess (CUDA hidden, Megatron's CPU shims, gloo).

    python -m tests.gpu._cpu_reference STATE_DICT.pt OUT.pt

Builds the tiny TRACE model (guided_layers="all", full records), loads the GPU model's weights, runs one
recorded forward on the harness batch and saves logits, MoE outputs per layer and the recorded guidance.
"""

from __future__ import annotations

import os
import sys

import torch


def main(state_path: str, out_path: str) -> None:
    from megatron_trace.config import TraceConfig
    from megatron_trace.megatron import trace_record, trace_spec
    from tests.megatron.harness import (
        apply_cpu_shims,
        batch,
        build_model,
        destroy_parallel,
        free_port,
        init_parallel,
        stock_spec,
        tiny_config,
    )

    apply_cpu_shims()
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    init_parallel(ep=1)
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    cfg = tiny_config()
    model = build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig(guided_layers="all", cache_mode="full")))
    model.load_state_dict(torch.load(state_path, map_location="cpu"), strict=True)
    moe_out, hooks = {}, []
    for i, layer in enumerate(model.decoder.layers):
        hooks.append(layer.mlp.register_forward_hook(
            lambda m, a, out, i=i: moe_out.__setitem__(i, out[0].detach().clone())))
    tokens, pos, mask, _ = batch()
    with trace_record(model, compact=False) as h, torch.no_grad():
        logits = model(tokens, pos, mask)
    rec = h.recorded()
    torch.save({"logits": logits, "moe": moe_out, "sites": dict(rec.sites), "routing": dict(rec.routing)}, out_path)
    destroy_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
