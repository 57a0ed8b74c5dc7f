"""Megatron-Core ``TransformerConfig`` and ``GPTModel`` for a HF Qwen3-MoE config.

Router settings reproduce Qwen3-MoE exactly (QWEN3MOE_FACTS.md): softmax scores, top-k; with
``norm_topk_prob=True`` top-k runs on the logits and the softmax over the k (== softmax, top-k,
renormalise: ``moe_router_pre_softmax=False``), with ``norm_topk_prob=False`` softmax over all
experts first (``pre_softmax=True``). Load balancing defaults to "none" (inference / RL with
routing replay). Fusions that need TE/Apex are off; the layer spec is Megatron's local spec
(``SequentialMLP`` experts), the one the TRACE plugin keeps name-compatible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_supported(hf_config) -> None:
    """Raise for Qwen3-MoE variants this bridge does not map (dense layers, RoPE scaling, ...)."""
    if getattr(hf_config, "model_type", None) != "qwen3_moe":
        raise ValueError(f"model_type={getattr(hf_config, 'model_type', None)!r}: this bridge maps 'qwen3_moe' only")
    if list(getattr(hf_config, "mlp_only_layers", []) or []) or getattr(hf_config, "decoder_sparse_step", 1) != 1:
        raise NotImplementedError("dense (mlp_only_layers / decoder_sparse_step != 1) layers are not mapped yet")
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"rope_type={rope.get('rope_type')!r}: only the default RoPE is mapped")
    if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", False):
        raise NotImplementedError("sliding-window attention is not mapped")
    if getattr(hf_config, "attention_bias", False):
        raise NotImplementedError("attention_bias=True: the q/k/v/o projection biases are not mapped (o_proj's has "
                                  "no Megatron counterpart without add_bias_linear)")
    quant = getattr(hf_config, "quantization_config", None)
    if quant:
        raise NotImplementedError(f"quantization_config={dict(quant)!r}: only unquantized (bf16 / fp16 / fp32) "
                                  "checkpoints are mapped; start from the model's unquantized release")
    if getattr(hf_config, "num_experts_per_tok", 2) == 1 and getattr(hf_config, "norm_topk_prob", False):
        raise NotImplementedError(
            "num_experts_per_tok=1 with norm_topk_prob=True: every token's routing weight is 1.0, which Megatron's "
            "router does not express (it refuses top-1 after the softmax, and moe_router_pre_softmax=True would "
            "weight each token by its softmax probability instead); mapped: num_experts_per_tok >= 2, or top-1 with "
            "norm_topk_prob=False")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act={act!r}: the experts and MLPs are mapped as SwiGLU (silu) only")


def _model_fields(c) -> dict:
    """The fields that make the Megatron model compute what the HF Qwen3-MoE computes (shapes, norms, activation,
    router): ``transformer_config_from_hf`` refuses an override that changes one of them."""
    return dict(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        ffn_hidden_size=c.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,  # (attention_bias is refused by check_supported)
        rotary_interleaved=False,
        num_moe_experts=c.num_experts,
        moe_ffn_hidden_size=c.moe_intermediate_size,
        moe_router_topk=c.num_experts_per_tok,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not c.norm_topk_prob,
        # Megatron router features Qwen3-MoE has no HF counterpart (or tensor) for, at their off values
        moe_router_enable_expert_bias=False,
        moe_router_topk_scaling_factor=None,
        moe_router_num_groups=None,
        moe_router_group_topk=None,
        moe_shared_expert_intermediate_size=None,
        # Qwen3-MoE has no multi-token-prediction layers (nor tensors for them): the bridge builds no MTP block, and
        # GPTModel with mtp_num_layers but no block splits the decoder's sequence in halves as if they were MTP states
        mtp_num_layers=None,
    )


def _refuse_model_overrides(model: dict, overrides: dict) -> None:
    """An override that changes the model's math would train a model that the HF checkpoint, its export and the
    rollout do not compute (e.g. sigmoid routing with an expert bias: the export has no tensor for the bias)."""
    bad = {k: v for k, v in overrides.items() if k in model and v != model[k]}
    if bad:
        shown = ", ".join(f"{k}={v!r} (this config: {model[k]!r})" for k, v in bad.items())
        raise ValueError(f"config override(s) {shown} change what the model computes, so it would no longer be the "
                         "HF Qwen3-MoE it loads from and exports to; override settings only (parallelism, precision, "
                         "recompute, load balancing, dropout, fusions)")


def check_checkpoint_config(hf_config, saved, where: str) -> None:
    """Raise unless ``hf_config`` (the model loading ``where``) computes what ``saved`` (the config ``where`` was saved
    with: a HF checkpoint's config.json, the one every rollout engine reads) says. Shapes are checked on the tensors;
    this is for the fields no tensor has: top-k, router normalisation, RoPE theta, norm epsilon (a top-k of another
    config loaded silently and trained another model than the one the rollout serves: slime#1059)."""
    if getattr(saved, "model_type", None) != getattr(hf_config, "model_type", None):
        raise ValueError(f"{where} is of model_type={getattr(saved, 'model_type', None)!r}, the config loading it "
                         f"{getattr(hf_config, 'model_type', None)!r}")
    mine, theirs = (_computed_fields(c) for c in (hf_config, saved))
    bad = [f"{k}={mine[k]!r} (saved: {theirs[k]!r})" for k in mine if mine[k] != theirs[k]]
    if bad:
        a, b = hf_config.to_dict(), saved.to_dict()  # (the HF names of the Megatron fields above)
        hf = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k not in _CONFIG_META)
        raise ValueError(f"the config loading {where} computes another model than the one saved there: "
                         f"{', '.join(bad)} (HF config fields that differ: {hf}); load it with the config it was saved "
                         "with (a HF checkpoint's config.json: AutoConfig.from_pretrained)")


_CONFIG_META = ("_name_or_path", "architectures", "dtype", "torch_dtype", "transformers_version")


def _computed_fields(c) -> dict:
    """What a Qwen3-MoE config makes the model compute (TransformerConfig and GPTModel fields)."""
    return {**_model_fields(c), **gpt_model_kwargs(c)}


def rope_theta(hf_config) -> float:
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if "rope_theta" in rope:  # transformers >= 5
        return float(rope["rope_theta"])
    return float(hf_config.rope_theta)


DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOAD_BALANCING = ("none", "aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn")
"""Megatron's ``moe_router_load_balancing_type`` values (another string balanced nothing, with the aux-loss coefficient
of the HF config set, silently)."""


def _check_build_settings(dtype, tensor_parallel, expert_parallel, load_balancing) -> None:
    """Raise naming a dtype, parallel size or load balancing the config would take but not mean ("bf16" and
    torch.int8 were taken as params_dtype, a tensor_parallel of 0 was a ZeroDivisionError, True an expert_parallel of
    1)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {DTYPES}")
    for name, v in (("tensor_parallel", tensor_parallel), ("expert_parallel", expert_parallel)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    if load_balancing not in LOAD_BALANCING:
        raise ValueError(f"load_balancing={load_balancing!r} must be one of {LOAD_BALANCING}")


def transformer_config_from_hf(
    hf_config,
    *,
    dtype: torch.dtype = torch.bfloat16,
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    load_balancing: str = "none",
    **overrides,
):
    """The TransformerConfig of a Qwen3-MoE HF config; ``overrides`` win over every setting, and one that changes the
    model (its shapes, norms, activation or router: ``_model_fields``) is refused by name."""
    from megatron.core.transformer import TransformerConfig

    check_supported(hf_config)
    _check_build_settings(dtype, tensor_parallel, expert_parallel, load_balancing)
    model = _model_fields(hf_config)
    _refuse_model_overrides(model, overrides)
    c = hf_config
    kw = dict(
        **model,
        attention_dropout=float(getattr(c, "attention_dropout", 0.0)),
        hidden_dropout=0.0,
        init_method_std=getattr(c, "initializer_range", 0.02),
        # MoE settings (the router itself is in the model fields)
        moe_router_load_balancing_type=load_balancing,
        moe_aux_loss_coeff=float(getattr(c, "router_aux_loss_coef", 0.0)) if load_balancing != "none" else 0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        # precision and parallelism
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=tensor_parallel,
        expert_model_parallel_size=expert_parallel,
        sequence_parallel=tensor_parallel > 1,
        variable_seq_lengths=True,
        # fusions that need TE / Apex / CUDA
        persist_layer_norm=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def gpt_model_kwargs(hf_config) -> dict:
    """GPTModel arguments besides the config and the spec."""
    return dict(
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )


def local_layer_spec(hf_config):
    """Megatron's local (no-TE) layer spec with routed experts (``SequentialMLP``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(
        num_experts=hf_config.num_experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )


def build_gpt_model(hf_config, config=None, *, spec=None, pre_process: bool = True, post_process: bool = True,
                    **config_kw):
    """A randomly initialised Megatron ``GPTModel`` for ``hf_config`` (Megatron parallel state must be set up)."""
    from megatron.core.models.gpt import GPTModel

    config = config if config is not None else transformer_config_from_hf(hf_config, **config_kw)
    return GPTModel(config=config, transformer_layer_spec=spec if spec is not None else local_layer_spec(hf_config),
                    pre_process=pre_process, post_process=post_process, **gpt_model_kwargs(hf_config))
