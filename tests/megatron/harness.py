"""Test-only harness: run Megatron-Core 0.16.1 on CPU (gloo) and build tiny MoE GPT models.

The CPU shims live in ``megatron_trace.testing.megatron_cpu`` (shared with the CPU demo); fixtures and
spawned workers apply them, product code never patches anything.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # Megatron's jit_fuser is torch.compile: eager on CPU

import torch  # noqa: E402

from megatron_trace.testing.megatron_cpu import (  # noqa: E402,F401  (re-exported for the tests)
    allow_torch_norm_with_sequence_parallel,
    apply_cpu_shims,
    free_port,
)

VOCAB, SEQ, HIDDEN, FFN, LAYERS, EXPERTS, TOPK, HEADS, GROUPS = 128, 16, 64, 64, 4, 8, 2, 4, 2
MROPE_SECTION = [4, 2, 2]  # the 8 rotary frequencies of head_dim 16 (``build_model(..., "mrope")``)


def init_parallel(ep: int = 1, tp: int = 1, seed: int = 1234) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1
    )
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay

    parallel_state.destroy_model_parallel()
    RouterReplay.clear_global_router_replay_instances()


class CudaOnCpu(torch.overrides.TorchFunctionMode):
    """Around Megatron code that makes CUDA tensors outright (its optimizer: build, ``zero_grad``, ``step``, which also
    accepts only ``torch.cuda.*Tensor`` parameters; the fully parallel checkpoint load's exchange buffers). Inside,
    tensors asked for on CUDA are made on the CPU, ``Tensor.cuda()`` is the tensor, and ``Tensor.type()`` names the
    CUDA type."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


class MegatronTraining:
    """Megatron's DDP (distributed optimizer, overlapped gradient reduce, ``overlap_param_gather=overlap``, buckets
    of ``bucket_size`` elements) and its distributed Adam around ``model``, on CPU ranks (gloo)."""

    def __init__(self, model, config, *, overlap: bool, bucket_size: int = 40_000, lr: float = 1e-2):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.ddp = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=True,
            overlap_param_gather=overlap, bucket_size=bucket_size))
        self._on_cpu = CudaOnCpu()
        with self._on_cpu:
            self.optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, bf16=False,
                                                                    use_distributed_optimizer=True), [self.ddp])

    def step(self, loss, within=None) -> None:
        """One optimizer step on the gradient of ``loss(ddp)``, forward and backward inside ``within(ddp)`` if
        given (e.g. ``lambda m: trace_guidance(m, None)``)."""
        self.ddp.zero_grad_buffer()
        with self._on_cpu:
            self.optimizer.zero_grad()
        with within(self.ddp) if within is not None else contextlib.nullcontext():
            loss(self.ddp).backward()
        self.ddp.finish_grad_sync()
        with self._on_cpu:
            assert self.optimizer.step()[0]


def tiny_config(**overrides):
    """4 layers, hidden 64, 8 experts top-2, GQA (4 heads, 2 KV groups of head_dim 16), bf16."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN,
        num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=HIDDEN // HEADS,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_enable_routing_replay=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True, pipeline_dtype=torch.bfloat16,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, moe_permute_fusion=False, init_method_std=0.05,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def stock_spec(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")


def mtp_spec(config, layer_spec=None):
    """The MTP block spec for ``config.mtp_num_layers``: of ``layer_spec``, else of the stock decoder's last layer
    spec, as the Megatron-LM patch's ``gpt_builder`` builds it (MTP layers keep the stock spec)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_mtp_block_spec

    if layer_spec is None:
        layer_spec = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization="RMSNorm")[-1]
    return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False)


def build_model(config, spec, seed: int = 0, mtp_block_spec=None, position_embedding_type: str = "rope"):
    """A GPTModel on CPU with deterministic weights (same seed -> same weights for any spec). ``"mrope"`` (with
    ``tiny_config(mrope_section=MROPE_SECTION)``): RoPE at the positions the forward's ``position_ids`` [3, B, S]
    give (the same three rows: plain RoPE), e.g. restarting per sample of a packed row."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type=position_embedding_type, mtp_block_spec=mtp_block_spec)


def batch(b: int = 2, s: int = SEQ, seed: int = 0):
    """(tokens, position_ids, attention_mask, labels) for a causal LM batch."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, s), generator=g)
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.tril(torch.ones(1, 1, s, s, dtype=torch.bool)).logical_not()
    return tokens, pos, mask, torch.roll(tokens, -1, 1)


def padded_batch(lengths, left: bool, seed: int = 0):
    """(tokens, token_mask, position_ids [3, B, S], attention_mask) of samples of ``lengths`` tokens left- or
    right-padded to SEQ, each attending to its own tokens only, positions from 0 at its first token (the ``mrope``
    model of ``build_model``)."""
    B, S = len(lengths), SEQ
    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))
    at, n = torch.arange(S)[None], torch.tensor(lengths)[:, None]
    tm = at >= S - n if left else at < n
    pos = (tm.long().cumsum(1) - 1).clamp(min=0)
    mask = ~(torch.ones(S, S, dtype=torch.bool).tril()[None] & tm[:, None, :]).unsqueeze(1)
    return tokens, tm, pos.expand(3, B, S), mask


def packed_batch(tokens, tm, cu: list[int], total: int):
    """The packed forward's (tokens [1, T], position_ids [3, 1, T], block-diagonal causal mask [1, 1, T, T]):
    sample b's tokens at cu[b]..., its segment's positions restarting at 0; the tail padding a segment of its own."""
    B = tokens.shape[0]
    row, pos, seg = torch.zeros(1, total, dtype=tokens.dtype), torch.zeros(1, total, dtype=torch.long), torch.zeros(
        total, dtype=torch.long)
    for b, (start, end) in enumerate(zip(cu, [*cu[1:], total])):  # the B samples' segments, then the tail
        pos[0, start:end] = torch.arange(end - start)
        seg[start:end] = b
        if b < B:
            t = tokens[b, tm[b]]
            row[0, start:start + t.numel()] = t
    mask = ~((seg[:, None] == seg[None, :]) & torch.ones(total, total, dtype=torch.bool).tril())
    return row, pos.expand(3, 1, total), mask[None, None]


def logits(model, data) -> torch.Tensor:
    tokens, pos, mask, _ = data
    with torch.no_grad():
        return model(tokens, pos, mask)


def perturb_non_experts(model, scale: float, seed: int = 1) -> None:
    """Add relative noise to every non-expert parameter (a rollout engine with slightly different numerics)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                continue
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.add_((noise * scale * p.float().abs().mean()).to(p.dtype))


def ep_state_dict(full: dict, ep_rank: int, ep_size: int, num_experts: int = EXPERTS) -> dict:
    """The state dict of EP rank ``ep_rank`` from an EP=1 state dict (local expert i = global ep_rank*n + i)."""
    n = num_experts // ep_size
    out = {}
    for k, v in full.items():
        if ".local_experts." not in k:
            out[k] = v
            continue
        head, tail = k.split(".local_experts.")
        idx, rest = tail.split(".", 1)
        g = int(idx)
        if ep_rank * n <= g < (ep_rank + 1) * n:
            out[f"{head}.local_experts.{g - ep_rank * n}.{rest}"] = v
    return out
