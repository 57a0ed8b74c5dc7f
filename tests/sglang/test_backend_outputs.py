"""The SGLang backend's own routing of what goes in and out: each request's finish reason, and the expert-layer
format checks of ``update_weights`` (the backend, not only ``engine_tensors``, must pass its layers)."""

import pytest
import torch

from megatron_trace.rollout import SamplingParams
from megatron_trace.rollout.sglang.backend import SGLangRolloutBackend

from .test_backend_contract import CFG, FC1_ONLY, HF, _Engine, trainer_recipe


def test_each_request_keeps_its_own_finish_reason():
    eng = _Engine(finish={1: {"type": "stop", "matched": 6}, 2: {"type": "length", "length": 2}})
    b = SGLangRolloutBackend(eng, FC1_ONLY, HF, kv_cache_dtype="auto").generate(
        [[1, 2]] * 4, SamplingParams(max_new_tokens=2, stop_token_ids=(6,)))
    assert b.finish_reasons == ("length", "stop", "length", "length")


def _sglang_token_finish(sampling: dict, output_ids: list[int], eos_token_ids: set[int]) -> bool:
    """SGLang 0.5.10.post1's own ``Req._check_token_based_finish`` (read from its source: ``schedule_batch`` needs
    sgl_kernel to import) on its own ``SamplingParams`` built from ``sampling``: does the last token end the request?"""
    import ast
    import importlib.util
    import os
    import types

    sgl = pytest.importorskip("sglang.srt.sampling.sampling_params", reason="SGLang's own code: its venv")
    path = os.path.join(os.path.dirname(importlib.util.find_spec("sglang").origin), "srt", "managers",
                        "schedule_batch.py")
    src = open(path).read()
    req = next(n for n in ast.parse(src).body if getattr(n, "name", None) == "Req")
    fn = next(n for n in req.body if getattr(n, "name", None) == "_check_token_based_finish")
    scope = {"FINISH_MATCHED_TOKEN": lambda matched: ("stop", matched), "List": list}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), scope)
    req = types.SimpleNamespace(sampling_params=sgl.SamplingParams(**sampling), eos_token_ids=eos_token_ids,
                                tokenizer=None, output_ids=list(output_ids))
    return scope["_check_token_based_finish"](req, output_ids[-1:])


def test_sglang_stops_at_the_stop_tokens_and_only_ignores_eos_without_them():
    """SGLang's ``ignore_eos`` skips ``stop_token_ids`` too: every response ran to ``max_new_tokens`` past its stop
    token (the rollout protocol ends it after a stop token, kept). Without stop tokens EOS is still ignored."""
    from megatron_trace.rollout.sglang.backend import sampling_dict

    stop = sampling_dict(SamplingParams(max_new_tokens=8, stop_token_ids=(2, 9)))
    assert _sglang_token_finish(stop, [5, 9], eos_token_ids={7})
    assert not _sglang_token_finish(stop, [5, 6], eos_token_ids={7})
    assert not _sglang_token_finish(sampling_dict(SamplingParams(max_new_tokens=8)), [5, 7], eos_token_ids={7})
    # with stop tokens SGLang also stops at the model's EOS ids: such a response is refused, naming the token
    assert _sglang_token_finish(stop, [5, 7], eos_token_ids={7})
    eng = _Engine(finish={1: {"type": "stop", "matched": 7}})
    with pytest.raises(RuntimeError, match=r"request 1 stopped at 7, not one of .*stop_token_ids=\[2, 9\]"):
        SGLangRolloutBackend(eng, FC1_ONLY, HF, kv_cache_dtype="auto").generate(
            [[1, 2]] * 2, SamplingParams(max_new_tokens=2, stop_token_ids=(2, 9)))
    # a matched list passes only where every token of it is a stop token
    listed = SamplingParams(max_new_tokens=2, stop_token_ids=(2, 9))
    b = SGLangRolloutBackend(_Engine(finish={1: {"type": "stop", "matched": [2, 9]}}), FC1_ONLY, HF,
                             kv_cache_dtype="auto").generate([[1, 2]] * 2, listed)
    assert b.finish_reasons == ("length", "stop")
    with pytest.raises(RuntimeError, match=r"request 1 stopped at \[2, 7\], not one of"):
        SGLangRolloutBackend(_Engine(finish={1: {"type": "stop", "matched": [2, 7]}}), FC1_ONLY, HF,
                             kv_cache_dtype="auto").generate([[1, 2]] * 2, listed)


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
