"""Issue 11 item 1: the rollout backends check the trainer's QuantRecipe at startup and on every weight sync;
a flipped setting on one side fires with the field's name and nothing is applied."""

import ast
from pathlib import Path

import pytest
import torch

import megatron_trace
from megatron_trace.config import TraceConfig
from megatron_trace.manifest import QuantRecipe, RecipeMismatchError
from megatron_trace.rollout import HFRolloutBackend
from megatron_trace.rollout.audit import without_kv
from megatron_trace.rollout.hf_weights import checkpoint_tensors
from megatron_trace.rollout.sglang.backend import SGLangRolloutBackend, sglang_model_dtype

from ..rollout._tiny import tiny_config, tiny_model

CFG = TraceConfig(guided_layers="last_k", guided_last_k=2)
HF = tiny_config()
SG_HF = {**HF.to_dict(), "dtype": "bfloat16"}  # an exported checkpoint's config.json: SGLang's "auto" serves bf16
MOE = tuple(f"model.layers.{i}.mlp.experts" for i in range(3))
KV = tuple(f"model.layers.{i}.self_attn.kv_cache" for i in range(3))


def trainer_recipe(config=CFG, version=0, modules=MOE + KV, guided=(1, 2), dtype=torch.float32):
    """What the trainer writes (in the RL job: ``manifest.trainer_recipe(find_trace_layers(model))``)."""
    return QuantRecipe.from_config(config, guided_layers=guided, quantized_modules=modules, weight_version=version,
                                   dtype=dtype)  # (the hf backends below run float32, SGLang bfloat16)


def _backend(config=CFG, **kw):
    return HFRolloutBackend(tiny_model(), mode="fp4", trace_config=config, dtype=torch.float32, **kw)


def test_hf_backend_serves_the_trainers_recipe():
    be = _backend(recipe=trainer_recipe())
    assert be.recipe() == trainer_recipe()
    assert be.module_audit().quantized == tuple(sorted(MOE + KV))


@pytest.mark.parametrize("flip, field", [
    (dict(format="mxfp4"), "format"),
    (dict(mxfp4_scale_rule="ceil", format="mxfp4"), "scale_rule"),
    (dict(activation_amax="per_tensor"), "activation_amax"),
    (dict(cache_mode="full"), "cache_mode"),
    (dict(guided_last_k=1), "guided_layers"),
    (dict(kv_format="sglang_kvfp4"), "kv_format"),
    ("no_kv", "quantized_modules"),
])
def test_startup_check_names_the_flipped_field(flip, field):
    """Flip one setting on the rollout side only: construction fails naming the field."""
    config = without_kv(CFG) if flip == "no_kv" else CFG.replace(**flip)
    with pytest.raises(RecipeMismatchError, match=rf"{field}: trainer="):
        _backend(config, recipe=trainer_recipe())


def test_bf16_rollout_does_not_claim_fp4():
    be = HFRolloutBackend(tiny_model(), mode="bf16", trace_config=CFG, dtype=torch.float32)
    r = be.recipe()
    assert r.sites == () and r.quantized_modules == () and r.guided_layers == ()
    with pytest.raises(RecipeMismatchError, match="sites: trainer="):
        be.check_recipe(trainer_recipe())


def test_every_weight_sync_checks_the_recipe_and_applies_nothing_on_mismatch():
    be = _backend(recipe=trainer_recipe())
    before = {k: v.clone() for k, v in be.model.state_dict().items()}
    new = list(checkpoint_tensors(tiny_model(seed=1)))
    with pytest.raises(RecipeMismatchError, match="without the trainer's recipe"):
        be.update_weights(new)
    with pytest.raises(RecipeMismatchError, match="weight_version: trainer=5 hf rollout=1"):
        be.update_weights(new, recipe=trainer_recipe(version=5))  # the trainer says v5, the rollout would set v1
    with pytest.raises(RecipeMismatchError, match="trainer_rounding"):
        be.update_weights(new, version=1, recipe=trainer_recipe(CFG.replace(rounding="stochastic"), version=1))
    after = be.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and be.policy_version == 0
    be.update_weights(new, recipe=trainer_recipe(version=1))
    assert be.policy_version == 1 and be.recipe() == trainer_recipe(version=1)


def test_sglang_backend_checks_the_recipe_at_startup_and_sync():
    """The SGLang engine keeps its KV cache in BF16: a trainer quantizing KV is refused, one that does not is
    accepted; every sync needs the recipe (checked before the engine is touched)."""
    hf = SG_HF
    with pytest.raises(RecipeMismatchError, match="sites: trainer=.*kv_k"):
        SGLangRolloutBackend(None, CFG, hf, recipe=trainer_recipe(dtype=torch.bfloat16))
    cfg = without_kv(CFG)
    be = SGLangRolloutBackend(None, cfg, hf, recipe=trainer_recipe(cfg, modules=MOE, dtype=torch.bfloat16))
    with pytest.raises(RecipeMismatchError, match="without the trainer's recipe"):
        be.update_weights([])
    with pytest.raises(RecipeMismatchError, match="weight_version: trainer=0 sglang rollout=1"):
        be.update_weights([], recipe=trainer_recipe(cfg, modules=MOE, dtype=torch.bfloat16))
    assert be.policy_version == 0



def test_an_update_refused_after_the_recipe_check_keeps_the_old_recipe():
    """The recipe passes but a tensor is refused: the backend keeps its recipe of the weights it still holds."""
    be = _backend(recipe=trainer_recipe())
    bad = [(n, t[..., :1] if n.endswith("o_proj.weight") else t) for n, t in checkpoint_tensors(tiny_model(seed=1))]
    with pytest.raises(ValueError, match="o_proj.weight.*shape"):
        be.update_weights(bad, recipe=trainer_recipe(version=1))
    assert be.trainer_recipe == trainer_recipe() and be.policy_version == 0
    cfg = without_kv(CFG)
    sg = SGLangRolloutBackend(None, cfg, SG_HF, recipe=trainer_recipe(cfg, modules=MOE, dtype=torch.bfloat16))
    expert = "model.layers.0.mlp.experts.0.down_proj.weight"  # the engine holds it as packed NVFP4
    with pytest.raises(ValueError, match="send FP4 values"):
        sg.update_weights([(expert, torch.zeros(2))],
                          recipe=trainer_recipe(cfg, version=1, modules=MOE, dtype=torch.bfloat16))
    assert sg.trainer_recipe == trainer_recipe(cfg, modules=MOE, dtype=torch.bfloat16) and sg.policy_version == 0

def test_a_refused_recipe_check_leaves_no_ignore_behind():
    """``check_recipe(..., ignore=...)`` stored its ignore list before checking: a refused call left it, and every
    later sync then let those fields differ unseen (here the trainer's activation amax)."""
    be = _backend(recipe=trainer_recipe())
    with pytest.raises(RecipeMismatchError, match="cache_mode: trainer="):
        be.check_recipe(trainer_recipe(CFG.replace(cache_mode="full")), ignore=("activation_amax",))
    assert be.trainer_recipe == trainer_recipe()
    with pytest.raises(RecipeMismatchError, match="activation_amax: trainer='per_tensor'"):
        be.update_weights(checkpoint_tensors(tiny_model(seed=1)),
                          recipe=trainer_recipe(CFG.replace(activation_amax="per_tensor"), version=1))
    assert be.policy_version == 0
    # a check that passes keeps its ignore list for the syncs after it
    be.check_recipe(trainer_recipe(CFG.replace(activation_amax="per_tensor")), ignore=("activation_amax",))
    be.update_weights(checkpoint_tensors(tiny_model(seed=1)),
                      recipe=trainer_recipe(CFG.replace(activation_amax="per_tensor"), version=1))
    assert be.policy_version == 1


UNUSED = dict(activation_amax="per_tensor", rounding="stochastic")


@pytest.mark.parametrize("sites, kv_format, modules, quantizer, changes", [
    (("weights",), "", MOE, "weight_quantizer", UNUSED),
    (("kv_k", "kv_v"), "sglang_kvfp4", KV, "kv_quantizer", dict(UNUSED, format="mxfp4", mxfp4_scale_rule="ceil"))])
def test_settings_that_no_quantized_site_uses_are_no_mismatch(sites, kv_format, modules, quantizer, changes):
    """Weights alone (per-tensor, RNE) or K/V alone in SGLang's format (E8M0 ceil, ties away, whatever ``format``):
    ``activation_amax``, ``rounding`` (and there ``format``) act nowhere, so configs differing only there compute
    the same; the recipes named them and the check refused the agreeing sides."""
    base = TraceConfig(sites=sites, guided_sites=(), guided_layers="none", kv_format=kv_format)
    other = base.replace(**changes)
    assert getattr(base, quantizer)() == getattr(other, quantizer)()  # (the one quantizer of these sites)
    logits = []
    for cfg in (base, other):
        be = _backend(cfg)
        with be.forward_context() as model:
            logits.append(model(torch.tensor([[3, 4, 5, 6]]), **be.cache_kwargs(be.new_cache())).logits)
    assert torch.equal(*logits)
    be.check_recipe(trainer_recipe(base, modules=modules, guided=()))
    # with an expert activation site, each counts again
    act = base.replace(sites=(*sites, "expert_fc1_in"))
    fields = "format: .*" * ("format" in changes) + "activation_amax: trainer=.*trainer_rounding: trainer='stochastic'"
    with pytest.raises(RecipeMismatchError, match=fields):
        _backend(act).check_recipe(trainer_recipe(act.replace(**changes), guided=(),
                                                  modules=MOE + modules if kv_format else MOE))


def test_sites_named_in_another_order_are_the_same_recipe():
    """A trainer launched with ``--trace-sites weights,expert_fc1_in,...`` quantizes the sites of a default rollout
    config, named in another order (bit-equal logits); the recipes listed them as given and the check refused."""
    rev = CFG.replace(sites=CFG.sites[::-1], guided_sites=CFG.guided_sites[::-1])
    logits = []
    for cfg in (CFG, rev):
        be = _backend(cfg)
        with be.forward_context() as model:
            logits.append(model(torch.tensor([[3, 4, 5, 6]]), **be.cache_kwargs(be.new_cache())).logits)
    assert torch.equal(*logits)
    assert trainer_recipe(rev) == trainer_recipe()
    _backend(CFG).check_recipe(trainer_recipe(rev))
    with pytest.raises(RecipeMismatchError, match=r"sites: trainer=\('expert_fc1_in', 'expert_fc2_in', 'weights'\)"):
        _backend(CFG).check_recipe(trainer_recipe(without_kv(rev), modules=MOE))  # (another set still fires)


# ---- no numeric setting from the environment -------------------------------------------------------
ALLOWED = {("testing/megatron_cpu.py", "TORCHDYNAMO_DISABLE")}


def _environment_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, variable) of every read of the process environment: os.environ[...] loads, os.environ.get,
    os.getenv, os.environ.pop/copy/items/keys/values (setdefault and assignments are writes)."""
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            reads.append((node.lineno, _const(node.slice)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            name = _const(node.args[0]) if node.args else "?"
            if f.attr == "getenv" or (_is_environ(f.value) and f.attr in ("get", "pop", "copy", "items", "keys",
                                                                           "values")):
                reads.append((node.lineno, name))
            elif f.attr == "setdefault" and _is_environ(f.value) and _used_as_value(tree, node):
                reads.append((node.lineno, name))
    return sorted(reads)


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def _const(node) -> str:
    return node.value if isinstance(node, ast.Constant) else "?"


def _used_as_value(tree, call) -> bool:
    return not any(isinstance(n, ast.Expr) and n.value is call for n in ast.walk(tree))


def test_no_setting_is_read_from_environment_variables():
    root = Path(megatron_trace.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for line, var in _environment_reads(ast.parse(path.read_text())):
            if (rel, var) not in ALLOWED:
                found.append(f"{rel}:{line} reads {var}")
    assert not found, found


def test_the_environment_scan_fires_on_a_read():
    src = "import os\nBLOCK = int(os.environ.get('TRACE_BLOCK', '16'))\nX = os.environ['Y']\nos.getenv('Z')\n" \
          "os.environ.setdefault('A', '1')\nB = os.environ.setdefault('B', '2')\n"
    assert [v for _, v in _environment_reads(ast.parse(src))] == ["TRACE_BLOCK", "Y", "Z", "B"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_rollout_in_another_dtype_is_refused_naming_both(dtype):
    """An FP32 trainer against a BF16 (or FP16) rollout quantizes other inputs and dequantizes to other values
    (USER_NEEDS.md: xtuner#2044, the mismatch grew 25x); the recipes agreed on every field before."""
    be = HFRolloutBackend(tiny_model(), mode="fp4", trace_config=CFG, dtype=dtype)
    assert be.recipe().dtype == str(dtype).removeprefix("torch.")
    with pytest.raises(RecipeMismatchError, match=rf"dtype: trainer='float32' hf rollout='{be.recipe().dtype}'"):
        be.check_recipe(trainer_recipe())
    be.check_recipe(QuantRecipe.from_config(CFG, guided_layers=(1, 2), quantized_modules=MOE + KV, dtype=dtype))


@pytest.mark.parametrize(("config_dtype", "served"), [("bfloat16", "bfloat16"), ("float16", "float16"),
                                                       ("float32", "float16"), (None, "float16")])
def test_sglang_recipe_takes_the_engines_dtype(config_dtype, served):
    """ServerArgs.dtype wins where set; "auto" (what trace_server_args leaves) is SGLang 0.5.10's rule
    (model_config._get_and_verify_dtype): the config's dtype, float32 or none served in float16."""
    class Engine:
        server_args = type("Args", (), {"dtype": "float16", "kv_cache_dtype": "auto"})()

    hf = {**HF.to_dict(), "dtype": config_dtype}
    be = SGLangRolloutBackend(Engine(), CFG, hf, native=False)
    assert be.recipe().dtype == "float16"
    Engine.server_args.dtype = "auto"
    assert be.recipe().dtype == served
    assert SGLangRolloutBackend(None, CFG, hf, native=False).recipe().dtype == served  # no server_args: "auto"
    Engine.server_args.dtype = "BFloat16"
    assert be.recipe().dtype == "bfloat16"
    Engine.server_args.dtype = "fp8"
    with pytest.raises(ValueError, match="ServerArgs.dtype='fp8'.*valid: 'auto'"):
        be.recipe()


def test_sglang_auto_dtype_reads_torch_dtype_and_gemma():
    assert sglang_model_dtype("auto", {"torch_dtype": "bfloat16"}) == torch.bfloat16  # transformers < 4.56's key
    assert sglang_model_dtype(None, {"dtype": "float32", "model_type": "gemma3"}) == torch.bfloat16
    assert sglang_model_dtype("auto", {"dtype": "float8_e4m3fn"}) == torch.float16  # unknown: taken as float32
    assert sglang_model_dtype("auto", tiny_config(dtype="float16")) == torch.float16  # a transformers config
