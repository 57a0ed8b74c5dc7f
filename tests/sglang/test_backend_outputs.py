"""The SGLang backend's own routing of what goes in and out: each request's finish reason, and the expert-layer
format checks of ``update_weights`` (the backend, not only ``engine_tensors``, must pass its layers)."""

import pytest
import torch

from megatron_trace.rollout import SamplingParams
from megatron_trace.rollout.sglang.backend import SGLangRolloutBackend

from .test_backend_contract import CFG, FC1_ONLY, HF, _Engine, trainer_recipe


def test_each_request_keeps_its_own_finish_reason():
    eng = _Engine(finish={1: {"type": "stop", "matched": 6}, 2: {"type": "length", "length": 2}})
    b = SGLangRolloutBackend(eng, FC1_ONLY, HF, kv_cache_dtype="auto").generate([[1, 2]] * 4,
                                                                                  SamplingParams(max_new_tokens=2))
    assert b.finish_reasons == ("length", "stop", "length", "length")


def test_a_bare_string_finish_reason_is_read_as_its_type():
    """A bare string passes the abort check and is assembled as that type (it failed in assembly, after the check)."""
    eng = _Engine(finish={0: "stop", 2: "length"})
    b = SGLangRolloutBackend(eng, FC1_ONLY, HF, kv_cache_dtype="auto").generate([[1, 2]] * 3,
                                                                                  SamplingParams(max_new_tokens=2))
    assert b.finish_reasons == ("stop", "length", "length")
    with pytest.raises(RuntimeError, match="request 1 finished with finish_reason='abort'"):
        SGLangRolloutBackend(_Engine(finish={1: "abort"}), FC1_ONLY, HF, kv_cache_dtype="auto").generate(
            [[1, 2]] * 2, SamplingParams(max_new_tokens=2))


def _excluding_backend():
    cfg = CFG.replace(exclude_modules=("model.layers.0.mlp.experts",))
    eng = _Engine()
    be = SGLangRolloutBackend(eng, cfg, HF, kv_cache_dtype="fp4_e2m1", accept_kv_format_mismatch=True,
                              recipe=trainer_recipe(cfg))
    return eng, be, cfg


def test_update_weights_refuses_bf16_for_fp4_expert_layers_and_fp4_for_excluded_ones():
    """Layer 0's experts are BF16 in the engine (exclude_modules), layers 1 and 2 packed NVFP4: the backend passes
    both sets to ``engine_tensors``, so a value of the wrong kind reaches no engine."""
    eng, be, cfg = _excluding_backend()
    q = cfg.weight_quantizer().quantize(torch.randn(32, 64))
    name = "model.layers.{}.mlp.experts.1.down_proj.weight"
    with pytest.raises(ValueError, match="holds layer 1's routed experts as packed NVFP4; send FP4 values"):
        be.update_weights([(name.format(1), torch.zeros(32, 64))], recipe=trainer_recipe(cfg, version=1))
    with pytest.raises(ValueError, match="keeps layer 0's experts in BF16"):
        be.update_weights([(name.format(0), q)], recipe=trainer_recipe(cfg, version=1))
    assert eng.updates == [] and be.policy_version == 0
    be.update_weights([(name.format(0), torch.zeros(32, 64)), (name.format(2), q)],
                      recipe=trainer_recipe(cfg, version=1))
    assert eng.updates == [[name.format(0), *(name.format(2).removesuffix("weight") + s for s in
                                              ("weight", "weight_scale", "weight_scale_2", "weight_global_amax"))]]
