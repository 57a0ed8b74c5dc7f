"""ModelOpt NVFP4 export: file layout, dtypes, values against the formats reference, round trip."""

import dataclasses
import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from megatron_trace.bridge.sync import fp4_stream
from megatron_trace.config import TraceConfig
from megatron_trace.export import (
    build_modelopt_state,
    fc1_from_modelopt,
    fp4_from_modelopt,
    load_modelopt_state,
    modelopt_linear_tensors,
    quant_config_dict,
    save_modelopt_checkpoint,
)
from megatron_trace.export.modelopt import QUANT_CONFIG_FILE, exclude_modules_of
from megatron_trace.formats import mxfp4, nvfp4

from ._tiny import EXPERTS, FFN, HIDDEN, LAYERS, tiny_hf_config, tiny_named_weights

QUANT = TraceConfig().weight_quantizer()
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float32)


def _independent_decode(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes -> signed E2M1 values, written without megatron_trace.formats."""
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack((lo, hi), -1).reshape(*packed.shape[:-1], -1).long()
    mag = E2M1[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("modelopt")
    named = list(fp4_stream(tiny_named_weights(), QUANT))
    qcfg = save_modelopt_checkpoint(out, named, tiny_hf_config(), input_amax=3.5, trace_extras=True,
                                    trace_config=TraceConfig().to_dict())
    return out, qcfg, load_file(os.path.join(out, "model.safetensors"))


def test_without_a_trace_config_the_quant_config_has_no_trace_entry():
    assert "trace" not in quant_config_dict(["lm_head"])
    assert quant_config_dict([], trace_config={"format": "nvfp4"})["trace"] == {"format": "nvfp4"}


def test_files_and_quant_config(ckpt):
    out, qcfg, _ = ckpt
    assert sorted(os.listdir(out)) == ["config.json", "hf_quant_config.json", "model.safetensors"]
    on_disk = json.load(open(os.path.join(out, "hf_quant_config.json")))
    assert on_disk == qcfg
    q = on_disk["quantization"]
    assert q["quant_algo"] == "NVFP4" and q["group_size"] == 16 and q["kv_cache_quant_algo"] is None
    ex = set(q["exclude_modules"])
    assert {"lm_head", "model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.gate"} <= ex
    assert not [m for m in ex if ".experts." in m]
    assert "quantization_config" not in json.load(open(os.path.join(out, "config.json")))
    assert on_disk["trace"] == TraceConfig().to_dict()  # the TRACE SGLang method's TraceQuantConfig reads it


def _tiny_bf16_linears(layers: range) -> list[str]:
    """The tiny model's BF16 Linear modules, written out (with the SGLang-fused qkv_proj of each layer)."""
    names = ["lm_head", "model.embed_tokens"]
    for layer in layers:
        names += [f"model.layers.{layer}.self_attn.{p}_proj" for p in ("q", "k", "v", "o", "qkv")]
        names.append(f"model.layers.{layer}.mlp.gate")
    return sorted(names)


def test_exclude_modules_are_exactly_the_bf16_linears(ckpt):
    _, qcfg, _ = ckpt
    assert qcfg["quantization"]["exclude_modules"] == _tiny_bf16_linears(range(LAYERS))


def test_names_shapes_dtypes(ckpt):
    _, _, st = ckpt
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            for proj, (n, k) in {"gate_proj": (FFN, HIDDEN), "up_proj": (FFN, HIDDEN),
                                 "down_proj": (HIDDEN, FFN)}.items():
                p = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                assert st[f"{p}.weight"].dtype == torch.uint8 and st[f"{p}.weight"].shape == (n, k // 2)
                assert st[f"{p}.weight_scale"].dtype == torch.float8_e4m3fn
                assert st[f"{p}.weight_scale"].shape == (n, k // 16)
                for s in ("weight_scale_2", "input_scale", "weight_global_amax"):
                    assert st[f"{p}.{s}"].dtype == torch.float32 and st[f"{p}.{s}"].shape == ()
                assert f"{p}.weight" in st and f"model.layers.{layer}.mlp.experts.{e}.{proj}.bias" not in st
    assert st["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert st["model.norm.weight"].dtype == torch.bfloat16


def test_values_match_reference(ckpt):
    _, _, st = ckpt
    weights = dict(tiny_named_weights())
    for e in range(EXPERTS):
        p = f"model.layers.1.mlp.experts.{e}"
        fc1 = torch.cat([weights[f"{p}.gate_proj.weight"], weights[f"{p}.up_proj.weight"]])  # one matrix, one amax
        ref = nvfp4.quantize(fc1)
        amax = fc1.float().abs().amax()
        for proj, rows in (("gate_proj", slice(0, FFN)), ("up_proj", slice(FFN, 2 * FFN))):
            assert torch.equal(st[f"{p}.{proj}.weight"], ref.codes[rows])
            scales = st[f"{p}.{proj}.weight_scale"].view(torch.uint8)
            assert torch.equal(scales, ref.block_scales[rows].view(torch.uint8))
            assert torch.equal(st[f"{p}.{proj}.weight_scale_2"], amax / 2688.0)  # ModelOpt: amax / (6 * 448)
            assert torch.equal(st[f"{p}.{proj}.weight_global_amax"], amax)
            assert torch.equal(st[f"{p}.{proj}.input_scale"], torch.tensor(3.5) / 2688.0)
            # the engine's dequant (codes * block scale * weight_scale_2) approximates the trainer's fake-quant
            sf = st[f"{p}.{proj}.weight_scale"].float().repeat_interleave(16, -1)
            engine = _independent_decode(st[f"{p}.{proj}.weight"]) * sf * st[f"{p}.{proj}.weight_scale_2"]
            torch.testing.assert_close(engine, ref.dequantize()[rows], rtol=2e-7, atol=1e-9)
            # the exact reference decode: codes * sf / (2688 / amax)
            exact = _independent_decode(st[f"{p}.{proj}.weight"]) * sf / (torch.full_like(amax, 2688.0) / amax)
            assert torch.equal(exact, ref.dequantize()[rows])


def test_round_trip_bit_exact_with_trainer_fake_quant(ckpt):
    out, _, _ = ckpt
    state = load_modelopt_state(out)
    weights = dict(tiny_named_weights())
    for e in range(EXPERTS):
        p = f"model.layers.0.mlp.experts.{e}"
        fc1 = torch.cat([weights[f"{p}.gate_proj.weight"], weights[f"{p}.up_proj.weight"]])
        back = fc1_from_modelopt(state, 0, e)
        assert torch.equal(back.dequantize(torch.bfloat16), QUANT.fake_quantize(fc1))
        down = fp4_from_modelopt(state, f"{p}.down_proj")
        assert torch.equal(down.dequantize(torch.bfloat16), QUANT.fake_quantize(weights[f"{p}.down_proj.weight"]))


def test_without_extras_codes_exact_amax_derived(tmp_path):
    named = list(fp4_stream(tiny_named_weights(1), QUANT))
    state, _ = build_modelopt_state(named, input_amax=1.0)
    assert not [k for k in state if k.endswith("weight_global_amax")]
    q = fp4_from_modelopt(state, "model.layers.0.mlp.experts.0.down_proj")
    ref = nvfp4.quantize(dict(tiny_named_weights(1))["model.layers.0.mlp.experts.0.down_proj.weight"])
    assert torch.equal(q.codes, ref.codes)
    torch.testing.assert_close(q.dequantize(), ref.dequantize(), rtol=2e-7, atol=0)


def test_saturated_encode_scale_exports_its_decode_scale():
    """A weight amax below 2688 / FLT_MAX: its codes were encoded with S_enc = FLT_MAX, so weight_scale_2 is
    fp32(1 / FLT_MAX) (amax / 2688 would decode them FLT_MAX * amax / 2688 times too small), and the engine's
    codes * block scale * weight_scale_2 is the trainer's dequantization within an ulp (as for any amax: the
    reference divides by S_enc); the exact amax still reads back."""
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(2)) * 1e-37
    q = nvfp4.quantize(w)
    t = modelopt_linear_tensors("lin", q, input_amax=1.0, trace_extras=True)
    assert t["lin.weight_scale_2"].item() == 2.0**-128 and t["lin.weight_global_amax"].item() == q.global_amax.item()
    sf = t["lin.weight_scale"].float().repeat_interleave(16, -1)
    engine = _independent_decode(t["lin.weight"]) * sf * t["lin.weight_scale_2"]
    torch.testing.assert_close(engine, q.dequantize(), rtol=2e-7, atol=0)
    assert torch.equal(fp4_from_modelopt(t, "lin").dequantize(), q.dequantize())
    without = {k: v for k, v in t.items() if not k.endswith("weight_global_amax")}  # amax from weight_scale_2
    torch.testing.assert_close(fp4_from_modelopt(without, "lin").dequantize(), q.dequantize(), rtol=2e-7, atol=0)


def test_sharded_round_trip(tmp_path):
    named = list(fp4_stream(tiny_named_weights(), QUANT))
    save_modelopt_checkpoint(tmp_path, named, tiny_hf_config(), input_amax=2.0, max_shard_bytes=4096)
    files = sorted(os.listdir(tmp_path))
    assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) > 1
    single, _ = build_modelopt_state(named, input_amax=2.0)
    state = load_modelopt_state(tmp_path)
    assert state.keys() == single.keys()
    assert all(torch.equal(state[k].view(torch.uint8) if state[k].dtype == torch.float8_e4m3fn else state[k],
                           single[k].view(torch.uint8) if single[k].dtype == torch.float8_e4m3fn else single[k])
               for k in state)


def test_exports_of_the_same_weights_are_the_same_bytes(tmp_path):
    """A checkpoint's files hash alike across exports of the same weights (content-addressed stores, "did the
    export change?"): the shards' safetensors metadata held two keys, written in a random order."""
    named = list(fp4_stream(tiny_named_weights(), QUANT))
    runs = [tmp_path / str(i) for i in range(4)]
    for out in runs:
        save_modelopt_checkpoint(out, named, tiny_hf_config(), input_amax=2.0, max_shard_bytes=4096)
    files = sorted(os.listdir(runs[0]))
    assert len([f for f in files if f.endswith(".safetensors")]) > 1
    for out in runs[1:]:
        assert sorted(os.listdir(out)) == files
        assert all((out / f).read_bytes() == (runs[0] / f).read_bytes() for f in files), out


def test_a_new_export_replaces_an_earlier_sharded_one(tmp_path):
    """An earlier sharded checkpoint in the directory: its index and shards are removed, so loaders read the new
    single file (a stale index would point them at the old shards)."""
    old = list(fp4_stream(tiny_named_weights(1), QUANT))
    save_modelopt_checkpoint(tmp_path, old, tiny_hf_config(), input_amax=2.0, max_shard_bytes=4096)
    (tmp_path / "notes.txt").write_text("kept")
    new = list(fp4_stream(tiny_named_weights(2), QUANT))
    save_modelopt_checkpoint(tmp_path, new, tiny_hf_config(), input_amax=2.0)
    assert sorted(f for f in os.listdir(tmp_path) if "safetensors" in f) == ["model.safetensors"]
    assert (tmp_path / "notes.txt").read_text() == "kept"
    want, _ = build_modelopt_state(new, input_amax=2.0)
    got = load_modelopt_state(tmp_path)
    key = "model.layers.0.mlp.experts.0.down_proj.weight"
    assert got.keys() == want.keys() and torch.equal(got[key], want[key])


def test_experts_kept_bf16_by_exclude_modules_are_exported_bf16_and_excluded(tmp_path):
    """``TraceConfig.exclude_modules`` experts come as BF16 (``fp4_stream(..., bf16_layers=...)``, as the weight
    sync sends them): stored in bf16 and listed in ``exclude_modules``; FP4 values for them are refused."""
    cfg = TraceConfig(exclude_modules=("model.layers.0.mlp.experts",))
    named = list(fp4_stream(tiny_named_weights(), QUANT, bf16_layers=(0,)))
    qcfg = save_modelopt_checkpoint(tmp_path, named, tiny_hf_config(), input_amax=2.0, trace_config=cfg.to_dict())
    # layer 0's experts and no other layer's (an engine would load layer 1's FP4 experts as BF16)
    assert qcfg["quantization"]["exclude_modules"] == sorted([*_tiny_bf16_linears(range(LAYERS)),
                                                              "model.layers.0.mlp.experts"])
    assert not any(".experts." in m for m in qcfg["quantization"]["exclude_modules"])  # not per expert Linear
    state = load_modelopt_state(tmp_path)
    w = dict(named)
    key = "model.layers.0.mlp.experts.1.up_proj.weight"
    assert state[key].dtype == torch.bfloat16 and torch.equal(state[key], w[key])
    assert "model.layers.0.mlp.experts.1.up_proj.weight_scale" not in state
    assert "model.layers.1.mlp.experts.1.up_proj.weight_scale" in state
    with pytest.raises(ValueError, match="keeps layer 0's experts in BF16 \\(got an FP4Tensor\\)"):
        save_modelopt_checkpoint(tmp_path, list(fp4_stream(tiny_named_weights(), QUANT)), tiny_hf_config(),
                                 input_amax=2.0, trace_config=cfg.to_dict())
    with pytest.raises(TypeError, match="BF16 experts only for layers"):  # BF16 experts without the exclusion
        save_modelopt_checkpoint(tmp_path, named, tiny_hf_config(), input_amax=2.0)
    # the TraceConfig itself, as build_modelopt_state takes it: the same checkpoint
    assert save_modelopt_checkpoint(tmp_path / "c", named, tiny_hf_config(), input_amax=2.0, trace_config=cfg) == qcfg
    assert all((tmp_path / "c" / f).read_bytes() == (tmp_path / f).read_bytes() for f in ("config.json",
                                                                                          QUANT_CONFIG_FILE))
    got = load_modelopt_state(tmp_path / "c")  # (not the shard's bytes: safetensors orders its metadata at random)
    raw = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    assert got.keys() == state.keys() and all(torch.equal(raw(got[k]), raw(state[k])) for k in state)
    with pytest.raises(TypeError, match="trace_config must be a TraceConfig, its dict or None, got str"):
        save_modelopt_checkpoint(tmp_path / "d", named, tiny_hf_config(), input_amax=2.0, trace_config="nvfp4")


def test_errors_name_the_problem():
    w = torch.randn(16, 32)
    with pytest.raises(ValueError, match="per-tensor"):
        modelopt_linear_tensors("x", nvfp4.quantize(w, per_row=True), 1.0)
    with pytest.raises(ValueError, match="input_amax"):
        modelopt_linear_tensors("x", nvfp4.quantize(w), 0.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        modelopt_linear_tensors("x", nvfp4.quantize(torch.randn(16, 24)), 1.0)
    with pytest.raises(ValueError, match="needs fmt='nvfp4', got 'mxfp4'"):
        modelopt_linear_tensors("x", mxfp4.quantize(w), 1.0)
    with pytest.raises(ValueError, match=r"expected a 2-D weight \[N, K\], got shape \(2, 16, 32\)"):
        modelopt_linear_tensors("x", nvfp4.quantize(torch.randn(2, 16, 32)), 1.0)  # a stacked [E, N, K] weight
    for bad in (float("inf"), float("nan"), -1.0):  # an inf input_scale would be written without a word
        with pytest.raises(ValueError, match="must be finite and > 0"):
            modelopt_linear_tensors("x", nvfp4.quantize(w), bad)
    named = [("model.layers.0.mlp.experts.0.down_proj.weight", w)]
    with pytest.raises(TypeError, match="FP4Tensor"):
        build_modelopt_state(named, 1.0)
    named = [("model.layers.0.mlp.experts.0.down_proj.weight", nvfp4.quantize(w))]
    with pytest.raises(KeyError, match="no input_amax for .model.layers.0.mlp.experts.0.down_proj.: give the static"):
        build_modelopt_state(named, {})
    prefix = "model.layers.0.mlp.experts.0.down_proj"
    assert build_modelopt_state(named, {prefix: 1.0})[0].keys() == build_modelopt_state(named, 1.0)[0].keys()
    with pytest.raises(ValueError, match=r"input_amax has 1 entries for no exported FP4 expert Linear, e\.g\. "
                                         r"\['model\.layers\.0\.mlp\.experts\.1\.down_proj'\]"):
        build_modelopt_state(named, {prefix: 1.0, "model.layers.0.mlp.experts.1.down_proj": 1.0})  # (was ignored)
    with pytest.raises(ValueError, match="quantization_config"):
        save_modelopt_checkpoint("/nonexistent", named, {"quantization_config": {}}, 1.0)


def _scale_bytes(q, byte: int) -> torch.Tensor:
    """``q``'s block scales with the first one's e4m3 bits set to ``byte``."""
    raw = q.block_scales.view(torch.uint8).clone()
    raw[0, 0] = byte
    return raw.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("field,bad,match", [
    ("block_scales", lambda q: q.block_scales.view(torch.uint8), r"block_scales must be torch.float8_e4m3fn \[16, 2\]"
                                                                  r".*got torch.uint8 \[16, 2\]"),
    ("block_scales", lambda q: q.block_scales.float(), "got torch.float32"),
    ("block_scales", lambda q: q.block_scales[:, :1], r"got torch.float8_e4m3fn \[16, 1\]"),
    ("codes", lambda q: q.codes.int(), r"codes must be torch.uint8 \[16, 16\].*got torch.int32"),
    ("global_amax", lambda q: torch.tensor(float("inf")), "global_amax=inf must be finite and >= 0"),
    ("global_amax", lambda q: torch.tensor(float("nan")), "global_amax=nan must be finite"),
    ("block_scales", lambda q: _scale_bytes(q, 0x7F), r"x: block_scales must be finite and >= 0 .*got 1 other\(s\), "
                                                      r"e.g. \[nan\]"),
    ("block_scales", lambda q: _scale_bytes(q, 0xB8), r"block_scales must be finite and >= 0 .*e.g. \[-1.0\]"),
], ids=["scales-uint8-view", "scales-fp32", "scales-short", "codes-int32", "amax-inf", "amax-nan", "scale-nan",
        "scale-negative"])
def test_an_fp4_weight_not_in_the_checkpoint_layout_is_refused(field, bad, match):
    """Written as given, a uint8 view of the block scales was stored as U8 (a loader that copies it into its
    float8_e4m3fn parameter converts numbers: scale 56 for code 0x38 = 1.0), a non-finite amax as an inf or NaN
    weight_scale_2 (an engine's output all NaN), a NaN (0x7F) or negative (0xB8 = -1.0) block scale as it was (NaN or
    sign-flipped weights in an engine; the quantizers never make one)."""
    q = nvfp4.quantize(torch.randn(16, 32, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match=match):
        modelopt_linear_tensors("x", dataclasses.replace(q, **{field: bad(q)}), 1.0)
    zero = nvfp4.quantize(torch.zeros(16, 32))  # an all-zero weight (amax 0) is a weight
    assert torch.equal(modelopt_linear_tensors("x", zero, 1.0)["x.weight"], zero.codes)


def test_an_input_amax_that_is_not_one_number_is_refused_naming_the_linear():
    """A per-row amax tensor (what the rollout records) or None given for one Linear raised torch's bare "shape '[]'
    is invalid for input of size 4" / "must be real number", naming neither the Linear nor input_amax."""
    prefix = "model.layers.0.mlp.experts.0.down_proj"
    named = [(prefix + ".weight", nvfp4.quantize(torch.randn(16, 32)))]
    with pytest.raises(ValueError, match=re.escape(f"{prefix}: input_amax must be one number") + ".*shape \\(4,\\)"):
        build_modelopt_state(named, {prefix: torch.ones(4)})
    with pytest.raises(ValueError, match=re.escape(f"{prefix}: input_amax must be one number") + ".*None"):
        build_modelopt_state(named, {prefix: None})
    state, _ = build_modelopt_state(named, {prefix: torch.tensor([2.0])})  # one number in a 1-element tensor
    assert state[prefix + ".input_scale"].shape == ()


@pytest.mark.parametrize("call,match", [
    # were accepted: True as an input amax of 1.0; one string's characters as the excluded modules; read back with a
    # K past the coded columns (or not an int) an FP4Tensor that dequantized to the coded K, silently
    (lambda t, q: modelopt_linear_tensors("l", q, True), r"l: input_amax must be one number .*got True"),
    (lambda t, q: quant_config_dict("model.layers.0.mlp"), r"exclude_modules='model.layers.0.mlp' must be a list of"),
    (lambda t, q: quant_config_dict([1]), r"exclude_modules=\[1\] must be a list of module-name patterns"),
    (lambda t, q: fp4_from_modelopt(t, "l", k=200), r"l: FP4Tensor of shape \(32, 200\) \(fmt='nvfp4', blocks of 16\) "
                                                    r"needs codes \(32, 104\) and block scales \(32, 13\), got "
                                                    r"\(32, 32\) and \(32, 4\)"),
    (lambda t, q: fp4_from_modelopt(t, "l", k=2.5), r"l: FP4Tensor.shape=\(32, 2.5\) must be ints >= 0"),
    (lambda t, q: fp4_from_modelopt({**t, "l.weight_scale": t["l.weight_scale"][:16]}, "l"),
     r"needs codes \(32, 32\) and block scales \(32, 4\), got \(32, 32\) and \(16, 4\)"),
], ids=["amax-bool", "exclude-str", "exclude-int", "k-past-codes", "k-float", "scales-of-other-rows"])
def test_bad_export_arguments_and_read_backs_are_named(call, match):
    q = nvfp4.quantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)))
    t = modelopt_linear_tensors("l", q, 1.0, trace_extras=True)
    with pytest.raises(ValueError, match=match):
        call(t, q)
    assert torch.equal(fp4_from_modelopt(t, "l", k=64).dequantize(), q.dequantize())  # (the valid twin)


def test_gate_and_up_quantized_apart_or_alone_are_refused():
    """An engine fuses gate and up into one w13 with one weight_scale_2: halves of different global amax (each HF
    tensor quantized on its own), or one half alone, would be decoded with the wrong scale."""
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(16, 32, generator=g), 3 * torch.randn(16, 32, generator=g)
    pre = "model.layers.0.mlp.experts.1."
    apart = [(pre + "gate_proj.weight", nvfp4.quantize(gate)), (pre + "up_proj.weight", nvfp4.quantize(up))]
    with pytest.raises(ValueError, match="layer 0 expert 1: gate and up halves of an FP4 fc1 weight must share one "
                                         "global amax"):
        build_modelopt_state(apart, 1.0)
    with pytest.raises(ValueError, match=r"layer 0 expert 1: only \['up_proj'\] given"):
        build_modelopt_state(apart[1:], 1.0)
    joint = fp4_stream([(pre + "gate_proj.weight", gate), (pre + "up_proj.weight", up)], QUANT)  # one fc1 matrix
    state, _ = build_modelopt_state(list(joint), 1.0)
    assert torch.equal(state[pre + "gate_proj.weight_scale_2"], state[pre + "up_proj.weight_scale_2"])


def test_a_failed_export_leaves_the_earlier_checkpoint_and_a_config_object_is_accepted(tmp_path):
    from transformers import Qwen3MoeConfig

    named = list(fp4_stream(tiny_named_weights(), QUANT))
    save_modelopt_checkpoint(tmp_path, named, tiny_hf_config(), input_amax=3.5)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(TypeError, match="not JSON serializable"):
        save_modelopt_checkpoint(tmp_path, named, {**tiny_hf_config(), "bad": object()}, input_amax=3.5)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    save_modelopt_checkpoint(tmp_path, named, Qwen3MoeConfig(**tiny_hf_config()), input_amax=3.5)
    assert json.loads((tmp_path / "config.json").read_text())["moe_intermediate_size"] == FFN


def test_config_dtype_is_the_dtype_of_the_unquantized_tensors(tmp_path):
    """A float32 source config (an fp32 master checkpoint) must not say float32 over BF16 tensors: SGLang and vLLM
    serve dtype="auto" in the config's dtype, a float32 one in float16, while the trainer ran BF16."""
    named = [(n, v.float() if isinstance(v, torch.Tensor) else v) for n, v in fp4_stream(tiny_named_weights(), QUANT)]
    given = {**tiny_hf_config(), "torch_dtype": "float32", "dtype": "float32"}
    save_modelopt_checkpoint(tmp_path, named, given, input_amax=2.0)
    cfg = json.load(open(tmp_path / "config.json"))
    assert (cfg["dtype"], cfg["torch_dtype"]) == ("bfloat16", "bfloat16")
    assert given["dtype"] == "float32"  # the caller's dict is left alone
    st = load_file(tmp_path / "model.safetensors")  # the float32 tensors given are stored as the config says
    assert {st[n].dtype for n, v in named if isinstance(v, torch.Tensor)} == {torch.bfloat16}
    assert torch.equal(st["model.embed_tokens.weight"], dict(tiny_named_weights())["model.embed_tokens.weight"])


def test_an_export_that_fails_midway_leaves_the_earlier_one_and_the_user_s_files(tmp_path):
    """A tensor safetensors cannot store (complex128: its serialisation raises) comes after several shards were
    written: the directory keeps its earlier export byte for byte, nothing is left beside it (the export had removed
    the earlier weights and rewritten the configs first); a later export keeps the user's README."""
    out = tmp_path / "ckpt"
    named = list(fp4_stream(tiny_named_weights(), QUANT))
    save_modelopt_checkpoint(out, named, tiny_hf_config(), input_amax=2.0, max_shard_bytes=4096)
    (out / "README.md").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    new = list(fp4_stream(tiny_named_weights(1), QUANT))
    cut = len(new) // 2
    bad = [*new[:cut], ("model.layers.1.mlp.gate.scale", torch.zeros(4, dtype=torch.complex128)), *new[cut:]]
    with pytest.raises(KeyError, match="complex128") as e:
        save_modelopt_checkpoint(out, bad, {**tiny_hf_config(), "note": "new"}, input_amax=2.0, max_shard_bytes=4096)
    assert any("the directory was left as it was" in n for n in e.value.__notes__)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    save_modelopt_checkpoint(out, new, tiny_hf_config(), input_amax=2.0)
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "hf_quant_config.json", "model.safetensors"]
    want, _ = build_modelopt_state(new, input_amax=2.0)
    key = "model.layers.0.mlp.experts.0.down_proj.weight"
    assert torch.equal(load_modelopt_state(out)[key], want[key])


def test_exclude_modules_are_the_bf16_linears_and_fused_linears_whose_shards_all_are():
    """Only 2-D ``.weight`` modules are listed (no norms, no biases), and a fused SGLang Linear (``qkv_proj``,
    ``gate_up_proj``) only where every one of its shards is BF16 (an independent list, written out)."""
    h = 32
    named = [("model.embed_tokens.weight", torch.randn(8, h)), ("model.norm.weight", torch.ones(h)),
             ("model.layers.0.input_layernorm.weight", torch.ones(h)),
             ("model.layers.0.self_attn.q_proj.bias", torch.randn(h))]
    named += [(f"model.layers.0.self_attn.{p}_proj.weight", torch.randn(h, h)) for p in "qkv"]
    named += [("model.layers.1.self_attn.q_proj.weight", torch.randn(h, h)),  # k and v of layer 1 not given
              ("model.layers.0.mlp.gate_proj.weight", torch.randn(h, h))]  # no up_proj
    _, exclude = build_modelopt_state(named, 1.0)
    attn = [f"model.layers.0.self_attn.{p}_proj" for p in ("q", "k", "v", "qkv")]
    assert exclude == sorted(["model.embed_tokens", *attn, "model.layers.1.self_attn.q_proj",
                              "model.layers.0.mlp.gate_proj"])
    # names that are not a module's weight (a 2-D scale, a bias) name no module
    assert exclude_modules_of(["model.a.weight", "model.b.scale", "model.c.bias"]) == ["model.a"]


def test_read_back_takes_the_exact_amax_where_the_decode_scale_does_not_round_trip():
    """``weight_global_amax`` is read back as the amax: for this weight ``weight_scale_2 * 2688`` is another fp32."""
    base = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    for amax in torch.linspace(0.1, 10.0, 200):
        q = QUANT.quantize(base / base.abs().max() * amax)
        t = modelopt_linear_tensors("x", q, 1.0, trace_extras=True)
        if not torch.equal(t["x.weight_scale_2"] * (6.0 * 448.0), q.global_amax.float()):
            break
    else:
        pytest.fail("no amax in the sweep whose decode scale does not round-trip")
    assert torch.equal(fp4_from_modelopt(t, "x").global_amax, q.global_amax.float())
    assert torch.equal(fp4_from_modelopt(t, "x").dequantize(), q.dequantize())


@pytest.mark.parametrize("cfg, match", [
    (TraceConfig(format="mxfp4"), r"TraceConfig.format='mxfp4': the ModelOpt export stores NVFP4 .*valid: 'nvfp4'"),
    (TraceConfig(sites=("expert_fc1_in", "expert_fc2_in"), guided_sites=("expert_fc1_in", "expert_fc2_in")),
     r"sites=\('expert_fc1_in', 'expert_fc2_in'\)\) does not quantize 'weights'"),
    (TraceConfig(enabled=False), r"TraceConfig\(enabled=False, .* does not quantize 'weights'"),
], ids=["mxfp4", "no-weights-site", "disabled"])
def test_a_config_whose_trainer_computes_other_expert_weights_is_refused_by_name(tmp_path, cfg, match):
    """The NVFP4 weights an export stores are what the trainer computes with only under an NVFP4 config that quantizes
    'weights'. Under an MXFP4 one, or one without the 'weights' site, the export was written (its trace entry said
    so, but stock ModelOpt loaders ignore it and served the NVFP4 weights against the trainer's MXFP4 / BF16 ones);
    now refused by name before anything is written."""
    named = list(fp4_stream(tiny_named_weights(), QUANT))
    with pytest.raises(ValueError, match=match):
        build_modelopt_state(named, 2.0, trace_config=cfg)
    with pytest.raises(ValueError, match=match):
        save_modelopt_checkpoint(tmp_path / "out", named, tiny_hf_config(), 2.0, trace_config=cfg.to_dict())
    assert not (tmp_path / "out").exists()
    save_modelopt_checkpoint(tmp_path / "ok", named, tiny_hf_config(), 2.0, trace_config=TraceConfig(ste_clip=True))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 3.4e38], ids=["nan", "inf", "past-bf16-max"])
@pytest.mark.parametrize("name", ["model.layers.1.self_attn.o_proj.weight",
                                  "model.layers.0.mlp.experts.1.up_proj.weight"], ids=["bf16-linear", "bf16-expert"])
def test_a_bf16_weight_non_finite_as_stored_is_refused_by_name(tmp_path, name, value):
    """The BF16 tensors (every non-expert weight; the experts ``TraceConfig.exclude_modules`` keeps) were written
    with their NaN/Inf, and a float32 value past bf16's largest (3.4e38 > 3.39e38) as the Inf it is once stored, while
    an FP4 expert's NaN/Inf was refused: an engine loaded them (its output all NaN). Now refused naming the weight,
    before anything is written; the same finite weight is stored bit-equal."""
    from megatron_trace.formats import NonFiniteError

    cfg = TraceConfig(exclude_modules=("model.layers.0.mlp.experts",))
    weights = [(n, w.float()) for n, w in tiny_named_weights()]
    bad = [(n, w.clone().index_put_((torch.tensor([0]), torch.tensor([3])), torch.tensor(value)) if n == name else w)
           for n, w in weights]
    with pytest.raises(NonFiniteError, match=re.escape(f"{name!r} holds NaN/Inf as stored (torch.bfloat16)")):
        build_modelopt_state(fp4_stream(bad, QUANT, dtype=None, bf16_layers=(0,)), 2.0, trace_config=cfg)
    with pytest.raises(NonFiniteError, match=re.escape(name)):
        save_modelopt_checkpoint(tmp_path / "out", fp4_stream(bad, QUANT, dtype=None, bf16_layers=(0,)),
                                 tiny_hf_config(), 2.0, trace_config=cfg)
    assert not (tmp_path / "out").exists()
    state, exclude = build_modelopt_state(fp4_stream(weights, QUANT, bf16_layers=(0,)), 2.0, trace_config=cfg)
    assert name.removesuffix(".weight") in exclude or "model.layers.0.mlp.experts" in exclude
    assert torch.equal(state[name].view(torch.int16), dict(weights)[name].bfloat16().view(torch.int16))


@pytest.mark.parametrize("pattern, bf16_layers", [
    ("model.layers.7.mlp.experts", None), ("layers.0.mlp.experts", None), ("model.layers.0.mlp.expert", None),
    ("model.layers.*.mlp.experts", range(LAYERS)), ("model.layers.1.mlp.*", (1,)), ("*.experts", range(LAYERS)),
], ids=["past-the-layers", "no-model-prefix", "typo", "all-layers-glob", "layer-1-glob", "suffix-glob"])
def test_an_exclude_pattern_is_refused_where_it_matches_no_module_and_kept_in_bf16_where_it_does(tmp_path, pattern,
                                                                                                  bf16_layers):
    """A ``TraceConfig.exclude_modules`` pattern that matches none of the model's modules (a typo, a layer past the
    model, no ``model.`` prefix) was written into the checkpoint's ``trace`` entry without a word, every expert in
    FP4, while the trainer and the engine refuse that config (``manifest.excluded_modules``): the trainer of the
    intended config kept a layer BF16 that this export serves in FP4. A glob that matches exports exactly the layers
    it matches in BF16, each listed in ``exclude_modules`` (read by SGLang's full-match ``is_layer_excluded``)."""
    from megatron_trace.manifest import ModulePatternError

    cfg = TraceConfig(exclude_modules=(pattern,))
    if bf16_layers is None:
        with pytest.raises(ModulePatternError, match=re.escape(f"TraceConfig.exclude_modules pattern {pattern!r} "
                                                               "matches none of the")):
            build_modelopt_state(fp4_stream(tiny_named_weights(), QUANT), 2.0, trace_config=cfg)
        with pytest.raises(ModulePatternError, match=re.escape(repr(pattern))):
            save_modelopt_checkpoint(tmp_path / "out", fp4_stream(tiny_named_weights(), QUANT), tiny_hf_config(), 2.0,
                                     trace_config=cfg)
        assert not (tmp_path / "out").exists()
        return
    state, exclude = build_modelopt_state(fp4_stream(tiny_named_weights(), QUANT, bf16_layers=bf16_layers), 2.0,
                                          trace_config=cfg)
    experts = [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    assert [m for m in exclude if m in experts] == [experts[i] for i in bf16_layers]
    for i in range(LAYERS):
        assert state[f"{experts[i]}.0.down_proj.weight"].dtype == (torch.bfloat16 if i in bf16_layers else torch.uint8)
