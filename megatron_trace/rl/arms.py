"""The five arms compared by the demo (README), as TraceConfig variants of one base config."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TraceConfig

ARMS = ("bf16", "fp4_naive", "fp4_qat", "trace", "trace_full")


@dataclass(frozen=True)
class Arm:
    """name; rollout mode ("bf16"|"fp4"); whether the trainer runs FP4 QAT; its TraceConfig."""

    name: str
    rollout_mode: str
    trainer_fp4: bool
    trace: TraceConfig

    @property
    def guided(self) -> bool:
        return self.trainer_fp4 and self.trace.guided_layers != "none"


def make_arm(name: str, base: TraceConfig) -> Arm:
    """bf16: BF16 both sides. fp4_naive: FP4 rollout, BF16 trainer. fp4_qat: FP4 QAT, own RNE.
    trace: guided QAT with ``base``'s policy (default: compact, deepest half). trace_full: all layers, full codes.
    Every arm but bf16 needs a ``base`` that quantizes something (TRACE enabled, sites given)."""
    if name in ARMS and name != "bf16" and not (base.enabled and base.sites):
        # (the rollout served BF16 under the arm's name: fp4_naive measured the BF16 floor, silently)
        raise ValueError(f"arm={name!r} runs an FP4 rollout, but the TraceConfig quantizes nothing (enabled="
                         f"{base.enabled}, sites={base.sites}): enable TRACE (trace.enabled=true) and give its sites, "
                         "or run arms=[bf16]")
    if name == "bf16":
        return Arm(name, "bf16", False, base.replace(guided_layers="none"))
    if name == "fp4_naive":
        return Arm(name, "fp4", False, base.replace(guided_layers="none"))
    if name == "fp4_qat":
        return Arm(name, "fp4", True, base.replace(guided_layers="none"))
    if name in ("trace", "trace_full") and (not base.guided_sites or name == "trace" and base.guided_layers == "none"):
        # (it ran as fp4_qat under the guided arm's name: the summary showed "TRACE" at plain QAT's mismatch)
        raise ValueError(f"arm={name!r} guides nothing with guided_layers={base.guided_layers!r} and guided_sites="
                         f"{base.guided_sites}: that is arm fp4_qat (plain FP4 QAT); give the guided arms guided sites "
                         "and layers")
    if name == "trace":
        return Arm(name, "fp4", True, base)
    if name == "trace_full":
        return Arm(name, "fp4", True, base.replace(guided_layers="all", cache_mode="full"))
    raise ValueError(f"arm={name!r} is not one of {ARMS}")
