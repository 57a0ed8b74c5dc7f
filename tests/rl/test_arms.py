"""``rl.arms``: the demo's five arms as TraceConfig variants of one base config (what each side runs)."""

import pytest

from megatron_trace.config import TraceConfig
from megatron_trace.rl.arms import ARMS, Arm, make_arm

BASE = TraceConfig(guided_layers="last_k", guided_last_k=2, cache_mode="compact", fallback="fail")

# arm: (rollout mode, trainer FP4 QAT, guided, its TraceConfig)
WANT = {
    "bf16": ("bf16", False, False, BASE.replace(guided_layers="none")),
    "fp4_naive": ("fp4", False, False, BASE.replace(guided_layers="none")),
    "fp4_qat": ("fp4", True, False, BASE.replace(guided_layers="none")),
    "trace": ("fp4", True, True, BASE),
    "trace_full": ("fp4", True, True, BASE.replace(guided_layers="all", cache_mode="full")),
}


@pytest.mark.parametrize("name", ARMS)
def test_each_arm_runs_what_the_readme_says_and_keeps_the_rest_of_the_base(name):
    """Only an FP4 trainer with guided layers is guided; arms without guidance drop the base's layer policy (its
    other settings, e.g. ``fallback``, stay); trace_full guides every layer with full codes."""
    arm = make_arm(name, BASE)
    assert (arm.name, arm.rollout_mode, arm.trainer_fp4, arm.guided, arm.trace) == (name, *WANT[name])


def test_guided_needs_an_fp4_trainer_and_guided_layers():
    assert not Arm("x", "fp4", False, BASE).guided  # a BF16 trainer has nothing to guide
    assert not Arm("x", "fp4", True, BASE.replace(guided_layers="none")).guided
    assert Arm("x", "fp4", True, BASE).guided


@pytest.mark.parametrize("base", [BASE.replace(enabled=False), BASE.replace(sites=(), guided_sites=())],
                         ids=["disabled", "no-sites"])
def test_an_fp4_arm_of_a_config_that_quantizes_nothing_is_refused(base):
    """trace.enabled=false ran fp4_naive's rollout in BF16 under its name (its mismatch was the bf16 arm's, 1x the
    floor, in the summary); the other FP4 arms failed only when their trainer or sync was built, after the SFT warm-up
    and the arms before them. The demo calls make_arm for every arm before any work."""
    for name in ARMS[1:]:
        with pytest.raises(ValueError, match=rf"arm='{name}' runs an FP4 rollout, but the TraceConfig quantizes no"):
            make_arm(name, base)
    assert make_arm("bf16", base).rollout_mode == "bf16"  # (the floor: nothing quantized anyway)


@pytest.mark.parametrize("base", [BASE.replace(guided_layers="none"), BASE.replace(guided_sites=())],
                         ids=["no-layers", "no-sites"])
def test_a_guided_arm_that_guides_nothing_is_refused(base):
    """trace.guided_layers=none (or no guided sites) ran the trace arm as plain FP4 QAT under its name (trace_full
    with no guided sites too): the summary showed "trace" at fp4_qat's mismatch. The unguided arms take it, and
    trace_full guides every layer whatever the base's layer policy."""
    names = ("trace", "trace_full") if not base.guided_sites else ("trace",)
    for name in names:
        with pytest.raises(ValueError, match=rf"arm='{name}' guides nothing .*: that is arm fp4_qat"):
            make_arm(name, base)
    assert not make_arm("fp4_qat", base).guided and make_arm("bf16", base).rollout_mode == "bf16"
    if base.guided_sites:
        assert make_arm("trace_full", base).guided
