"""The quant-recipe manifest: every numeric choice, written by the trainer and checked by each rollout backend.

Checked at startup and on every weight sync: a difference is an error naming the field and both
values (USER_NEEDS.md §3-5: silent recipe drift between trainer and engine). Nothing is read from
environment variables.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from .config import TraceConfig
from .formats import E2M1_MAX, E4M3_MAX, get_format

MANIFEST_VERSION = 1


class RecipeMismatchError(ValueError):
    """Trainer and rollout disagree on a numeric choice."""


@dataclass(frozen=True, kw_only=True)
class QuantRecipe:
    format: str
    block_size: int
    scale_dtype: str
    scale_rule: str
    e2m1_max: float
    e4m3_max: float
    weight_amax: str
    activation_amax: str
    rollout_rounding: str
    trainer_rounding: str
    sites: tuple[str, ...]
    guided_sites: tuple[str, ...]
    guided_layers: tuple[int, ...]
    cache_mode: str
    quantized_modules: tuple[str, ...]
    weight_version: int
    manifest_version: int = MANIFEST_VERSION

    @classmethod
    def from_config(
        cls, config: TraceConfig, *, guided_layers: tuple[int, ...], quantized_modules, weight_version: int = 0
    ) -> QuantRecipe:
        fmt = get_format(config.format, config.mxfp4_scale_rule)
        nv = config.format == "nvfp4"
        return cls(
            format=config.format,
            block_size=fmt.block_size,
            scale_dtype=str(fmt.scale_dtype).removeprefix("torch."),
            scale_rule="e4m3_rn_sat(448*6/amax_global*amax_block/6)" if nv else f"e8m0_{config.mxfp4_scale_rule}",
            e2m1_max=E2M1_MAX,
            e4m3_max=E4M3_MAX,
            weight_amax="per_tensor" if nv else "none",
            activation_amax=config.activation_amax if nv else "none",
            rollout_rounding="rne",
            trainer_rounding=config.rounding,
            sites=tuple(config.sites) if config.enabled else (),
            guided_sites=tuple(config.guided_sites) if guided_layers else (),
            guided_layers=tuple(guided_layers),
            cache_mode=config.cache_mode,
            quantized_modules=tuple(sorted(quantized_modules)),
            weight_version=int(weight_version),
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> QuantRecipe:
        d = json.loads(text)
        if d.get("manifest_version") != MANIFEST_VERSION:
            raise RecipeMismatchError(f"manifest_version={d.get('manifest_version')} != {MANIFEST_VERSION}")
        for k in ("sites", "guided_sites", "guided_layers", "quantized_modules"):
            d[k] = tuple(d[k])
        return cls(**d)

    def with_weight_version(self, version: int) -> QuantRecipe:
        return dataclasses.replace(self, weight_version=int(version))

    def check_matches(self, other: QuantRecipe, *, what: str = "rollout", ignore: tuple[str, ...] = ()) -> None:
        """Raise RecipeMismatchError listing every differing field (``ignore`` names fields to skip)."""
        diffs = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name not in ignore and a != b:
                diffs.append(f"{f.name}: trainer={_short(a)} {what}={_short(b)}")
        if diffs:
            raise RecipeMismatchError(f"quant recipe mismatch between trainer and {what}: " + "; ".join(diffs))


def _short(v) -> str:
    if isinstance(v, tuple) and len(v) > 6:
        return f"({len(v)} items: {', '.join(map(str, v[:3]))}, ...)"
    return repr(v)


def check_module_sets(trainer: set[str] | tuple, rollout: set[str] | tuple) -> None:
    """The quantized-module audit: both sides must quantize exactly the same modules (canonical HF names)."""
    t, r = set(trainer), set(rollout)
    if t != r:
        raise RecipeMismatchError(
            f"quantized module sets differ: only in trainer {sorted(t - r)[:8]} ({len(t - r)}), "
            f"only in rollout {sorted(r - t)[:8]} ({len(r - t)})"
        )
