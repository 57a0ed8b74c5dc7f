"""The rollout benchmarks' ``--modes`` and ``--variants``: a name they do not know is refused before any model is
built. Before, ``build_backends`` ran every mode not starting with ``fp4`` as bf16 under its own name (``fp8``: a
bf16 row labelled fp8), the generate benchmarks ran ``fp4f`` / ``fp4u`` as plain fp4 (their cache variants exist in
``bench_decode``'s decode loop only), ``bench_generate_graph`` ran an unknown variant as the eager fixed-buffer
steps, and ``profile_prefill`` raised a KeyError after building the model."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("modes, known", [(["bf16", "fp8"], None), (["fp4x"], None), ([], None),
                                          (["bf16", "fp4u"], "generate"), (["fp4f"], "generate")])
def test_build_backends_refuses_unknown_modes_before_building(bench_module, modes, known):
    bd = bench_module("bench_decode")
    kw = {} if known is None else {"known": bd.GENERATE_MODES}
    with pytest.raises(ValueError, match="each must be one of"):
        bd.build_backends(None, modes, "cpu", None, **kw)  # (no config: refused before the model is built)


@pytest.mark.parametrize("script", ["profile_generate", "profile_host", "bench_rollout_compiles", "profile_step_host"])
def test_generate_benchmarks_refuse_a_decode_only_mode(bench_module, script):
    mod = bench_module(script)
    for modes in ("bf16,fp8", "fp4u"):
        with pytest.raises(ValueError, match=r"each must be one of \('bf16', 'fp4'\)"):
            mod.main(["--smoke", "--modes", modes])


@pytest.mark.parametrize("script, variant", [("bench_generate_graph", "graf"), ("profile_prefill", "wgmma2")])
def test_unknown_variant_refused_by_name(bench_module, capsys, script, variant):
    mod = bench_module(script)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--smoke", "--variants", f"off,{variant}" if script == "bench_generate_graph" else variant])
    assert exc.value.code == 2 and f"['{variant}'] not among" in capsys.readouterr().err


def test_known_modes_are_accepted(bench_module):
    bd = bench_module("bench_decode")
    assert bd.GENERATE_MODES == ("bf16", "fp4") and set(bd.GENERATE_MODES) < set(bd.DECODE_MODES)
    cfg = bd.model_config(dict(bd.SMOKE_MODEL), 64)
    import torch

    backends = bd.build_backends(cfg, ["bf16", "fp4u", "fp4"], torch.device("cpu"), torch.float32)
    assert backends["fp4u"] is backends["fp4"] and backends["bf16"].mode == "bf16" and backends["fp4"].mode == "fp4"
