"""The rollout backend protocol and its typed inputs/outputs.

A backend samples responses for token-id prompts and returns, besides the tokens, what the
trainer needs to stay on the rollout's numerical path: the log-probs of the sampled tokens,
the expert choices of every MoE layer (routing replay) and the guidance records of the
selected (layer, site) pairs (TRACE). Shapes are batch-major and right-padded:

  tokens          int64 [B, S]          prompt then response, then ``pad_token_id``
  prompt_lens     int64 [B]
  response_lens   int64 [B]             sampled tokens, the stop token included
  response_mask   bool  [B, S]          True on response tokens
  logprobs        float32 [B, S]        ``log_softmax(logits / T)[tokens[b, t]]`` given ``tokens[b, :t]`` on
                                        response tokens, 0 elsewhere: the full distribution at the sampling
                                        temperature T (before top-p; T = 1 when greedy), what a trainer
                                        recomputes from its logits / T
  routing[layer]  int64 [B, S, topk]    experts chosen for the token at position t (as input)
  guidance[(layer, site)]  SiteGuidance (layout in ``megatron_trace.guidance.site``)

Layer ids count from 0. ``S = max(prompt_lens + response_lens)``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from ..formats import FP4Tensor
from ..guidance.site import SiteGuidance, SiteKey

MIN_TEMPERATURE = 1e-5
"""The smallest temperature above 0 (vLLM's and SGLang's greedy threshold)."""
STATIC_DECODE = ("auto", "off", "eager", "graph")
"""``HFRolloutBackend(static_decode=...)`` (``RLConfig.static_decode``): the decode loop."""
COMPILE_CHOICES = (False, True, "modules", "layers")
"""``HFRolloutBackend(compile=...)`` (``RLConfig.compile_rollout``): what ``torch.compile`` compiles."""


def is_compile_choice(value) -> bool:
    """One of ``COMPILE_CHOICES``, a bool being a bool (``1 in COMPILE_CHOICES`` holds: 1 == True)."""
    return isinstance(value, bool) or (isinstance(value, str) and value in COMPILE_CHOICES)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` is greedy; ``top_p`` keeps the smallest set of
    most likely tokens whose probability reaches ``top_p``. Generation of a sequence ends after
    a token in ``stop_token_ids`` (kept in the response) or after ``max_new_tokens`` tokens.
    ``seed`` makes sampling reproducible (None: fresh randomness) for the same batch: one generator serves the
    whole batch, so a prompt's sample depends on its batch (unlike per-request seeds in vLLM / SGLang)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        ids = self.stop_token_ids
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()  # (a 0-d tensor: one int)
        if is_int(ids):
            ids = (ids,)  # one stop token
        try:
            object.__setattr__(self, "stop_token_ids", tuple(ids))
        except TypeError as e:
            raise ValueError(f"SamplingParams.stop_token_ids={ids!r} must be token ids (ints >= 0)") from e
        t = check_temperature(self.temperature, "SamplingParams.temperature")
        p = self.top_p
        if not is_real(p) or not 0.0 < p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={p!r} must be in (0, 1]")
        n = self.max_new_tokens
        if not is_int(n) or n < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={n!r} must be an int >= 1")
        bad = [s for s in self.stop_token_ids if not is_int(s) or s < 0]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids has invalid id(s) {bad}: ids are ints >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(s) for s in self.stop_token_ids))
        sd = self.seed
        if sd is not None and (not is_int(sd) or not 0 <= sd < 2**63):
            raise ValueError(f"SamplingParams.seed={sd!r} must be None or an int in [0, 2**63)")
        # NumPy scalars (a config loaded with NumPy) as Python numbers
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "max_new_tokens", int(n))
        object.__setattr__(self, "seed", None if sd is None else int(sd))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if a stop token id is outside ``[0, vocab_size)``."""
        bad = [s for s in self.stop_token_ids if s >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


def check_temperature(t, name: str = "temperature") -> float:
    """``t`` as a float: 0 (greedy) or a finite number >= ``MIN_TEMPERATURE``; anything else raises, naming ``name``
    (the rollout samples and the trainer scores at the same temperature: both check it here)."""
    if not is_real(t) or not (t == 0 or MIN_TEMPERATURE <= t < math.inf):
        raise ValueError(f"{name}={t!r} must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE} (smaller ones "
                         "overflow the scaled logits)")
    return float(t)


def is_int(x) -> bool:
    """An integer id: a Python or NumPy integer (not a bool)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x) -> bool:
    """A real number: a Python or NumPy int or float (not a bool)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_bools(what: str, **flags) -> None:
    """Raise naming each of ``flags`` that is not a bool (a config's "no" is truthy: it turned the option on)."""
    bad = {k: v for k, v in flags.items() if not isinstance(v, bool)}
    if bad:
        raise ValueError(f"{what}: {', '.join(f'{k}={v!r}' for k, v in bad.items())} must be "
                         f"{'a bool' if len(bad) == 1 else 'bools'}")


def check_count(what: str, value, least: int = 1) -> int:
    """``value`` as a Python int when it is an int >= ``least`` (a NumPy int too; not a bool, not 2.0)."""
    if not is_int(value) or value < least:
        raise ValueError(f"{what}={value!r} must be an int >= {least}")
    return int(value)


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, *, max_positions: int | None = None,
                  max_new_tokens: int = 0) -> list[list[int]]:
    """``prompts`` as lists of Python ints; a clear error unless it is a non-empty list of non-empty token-id
    lists (ints, NumPy ints, 1-D arrays or tensors) in ``[0, vocab_size)`` whose prompt + ``max_new_tokens`` fit
    ``max_positions`` (the model's ``max_position_embeddings``: RoPE beyond it is outside what it was trained on)."""
    if not isinstance(prompts, Sequence) or isinstance(prompts, str | bytes) or len(prompts) == 0:
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor) or (not isinstance(p, Sequence) and hasattr(p, "tolist")):  # (NumPy arrays)
            p = p.tolist()
        if not isinstance(p, Sequence) or isinstance(p, str | bytes) or len(p) == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids, got {p!r}")
        kinds = [t for t in p if not is_int(t)]
        if kinds:
            raise ValueError(f"prompts[{i}] holds {kinds[0]!r} ({type(kinds[0]).__name__}), not an int token id")
        p = [int(t) for t in p]
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] has token id(s) {bad[:5]} outside [0, {vocab_size})")
        if max_positions is not None and len(p) + max_new_tokens > max_positions:
            raise ValueError(f"prompts[{i}] has {len(p)} tokens: with max_new_tokens={max_new_tokens} that is "
                             f"{len(p) + max_new_tokens} positions, beyond max_position_embeddings={max_positions}")
        out.append(p)
    return out


@dataclass
class RolloutBatch:
    """The result of one ``generate`` call (shapes in the module docstring)."""

    tokens: torch.Tensor
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    routing: dict[int, torch.Tensor] = field(default_factory=dict)
    guidance: dict[SiteKey, SiteGuidance] = field(default_factory=dict)
    policy_version: int = 0
    pad_token_id: int = 0
    finish_reasons: tuple[str, ...] = ()
    """Per sequence: "stop" (a stop token was sampled) or "length" (max_new_tokens reached)."""

    def __post_init__(self):
        b, s = self.tokens.shape
        for name in ("response_mask", "logprobs"):
            t = getattr(self, name)
            if tuple(t.shape) != (b, s):
                raise ValueError(f"RolloutBatch.{name} shape {tuple(t.shape)} != tokens shape {(b, s)}")
        for name in ("prompt_lens", "response_lens"):
            if tuple(getattr(self, name).shape) != (b,):
                raise ValueError(f"RolloutBatch.{name} must have shape ({b},)")
        for layer, r in self.routing.items():
            if r.dim() != 3 or tuple(r.shape[:2]) != (b, s):
                raise ValueError(f"RolloutBatch.routing[{layer}] shape {tuple(r.shape)} is not [{b}, {s}, topk]")

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        """Prompt + response length per sequence, int64 [B]."""
        return self.prompt_lens + self.response_lens

    @property
    def attention_mask(self) -> torch.Tensor:
        """bool [B, S]: True on prompt and response tokens, False on padding."""
        pos = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return pos.unsqueeze(0) < self.seq_lens.unsqueeze(1)

    def responses(self) -> list[list[int]]:
        """The sampled token ids of each sequence (stop token included)."""
        out = []
        for b in range(self.batch_size):
            p, r = int(self.prompt_lens[b]), int(self.response_lens[b])
            out.append(self.tokens[b, p : p + r].tolist())
        return out


WeightValue = torch.Tensor | FP4Tensor
"""A BF16 (or any float) tensor, or packed NVFP4/MXFP4 codes + scales of a routed-expert weight."""


@runtime_checkable
class RolloutBackend(Protocol):
    """What the RL driver needs from a rollout engine."""

    policy_version: int
    """Version of the weights in use; returned with every batch (async staleness control)."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> RolloutBatch:
        """Sample one response per prompt (token ids in, token ids out)."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, WeightValue]], *, version: int | None = None,
                       reset: bool = False) -> None:
        """Copy weights named as in the HF checkpoint into the engine, in place.

        ``FP4Tensor`` values are accepted for routed-expert weights in FP4 mode and are used as
        they are (no re-quantization). ``version`` sets ``policy_version``: strictly greater than the current one
        (default: +1), or any version with ``reset=True`` (see ``next_policy_version``); a refused version changes
        nothing.
        """
        ...


def weight_pairs(weights: Iterable[tuple[str, WeightValue]]) -> list[tuple[str, WeightValue]]:
    """``update_weights``' ``weights`` as a list of ``(name, value)`` pairs; ``TypeError`` naming the first item that
    is not one (a state dict passed itself, not its ``.items()``, iterates over its names), ``ValueError`` naming the
    names given more than once (which copy is meant is unknown: neither is dropped silently)."""
    if isinstance(weights, Mapping):
        raise TypeError(f"weights must be (name, tensor) pairs, got a {type(weights).__name__}: pass weights.items()")
    out = list(weights)
    for i, item in enumerate(out):
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            shown = repr(item) if isinstance(item, str | tuple | list) else type(item).__name__
            raise TypeError(f"weights[{i}] must be a (name, tensor) pair with an HF checkpoint name, got {shown[:120]}")
    twice = sorted(name for name, n in Counter(name for name, _ in out).items() if n > 1)
    if twice:
        raise ValueError(f"update_weights: {len(twice)} weight name(s) given more than once, e.g. {twice[:3]}: send "
                         "each weight once; nothing was updated")
    return out


def nonfinite_names(items: Iterable[tuple[str, torch.Tensor, torch.dtype | None]]) -> list[str]:
    """The names of ``(name, tensor, as_dtype)`` items whose floating-point tensor holds NaN/Inf once cast to
    ``as_dtype`` (None: as it is), with one host sync per device: a weight update's check before anything is loaded
    (a value beyond the target dtype's range loads as Inf)."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor, torch.dtype | None]]] = {}
    for name, t, as_dtype in items:
        if t.is_floating_point():
            by_device.setdefault(t.device, []).append((name, t, as_dtype))

    def bad(t: torch.Tensor, as_dtype) -> torch.Tensor:
        t = t if as_dtype is None or as_dtype == t.dtype else t.to(as_dtype)  # (one cast tensor alive at a time)
        return ~torch.isfinite(t.float() if t.element_size() == 1 else t).all()  # (float8: no isfinite kernel)

    names = []
    for group in by_device.values():
        flags = torch.stack([bad(t, as_dtype) for _, t, as_dtype in group]).tolist()
        names += [name for (name, _, _), b in zip(group, flags) if b]
    return names


def next_policy_version(current: int, version: int | None, *, reset: bool = False) -> int:
    """The ``policy_version`` a weight update sets; raises ``ValueError`` (before anything is changed) otherwise.

    A version names one set of weights: samples and guidance records carry it, and the trainer accepts a record
    whose version equals the one it recorded for the sample. An update under the current version or an older one
    would give other weights a name records already carry, and stale guidance would pass that check. So ``version``
    must be strictly greater than ``current``; None means ``current + 1``.

    ``reset=True`` sets ``version`` (given explicitly, any int >= 0) whatever the current one: a run's first sync of
    the trainer's initial weights and a resume or rollback to a checkpoint. The caller then owns the rule: guidance
    and samples generated since that version must be dropped (``GuidanceCache.invalidate``), as ``GRPORun.load``
    does."""
    if not isinstance(reset, bool):
        raise ValueError(f"reset={reset!r} must be a bool")
    if version is not None and (not is_int(version) or version < 0):
        raise ValueError(f"version={version!r} must be None or an int >= 0 (the policy version of these weights)")
    if reset:
        if version is None:
            raise ValueError(f"reset=True needs the version of the weights it loads (policy_version is {current}): "
                             "pass version=<the checkpoint's version>")
        return int(version)
    if version is None:
        return current + 1
    if version <= current:
        raise ValueError(f"version={version} is not newer than the rollout's policy_version={current}: a weight "
                         f"update's version must be strictly greater (> {current}; version=None sets {current + 1}), "
                         f"or guidance recorded under version {version} would look valid for other weights; "
                         "to reload a checkpoint or roll back on purpose pass reset=True and drop the guidance "
                         "generated since")
    return int(version)


@contextlib.contextmanager
def recipe_kept_on_failure(backend):
    """A weight update that fails leaves ``backend.trainer_recipe`` as it was: ``check_recipe`` stores the trainer's
    new recipe before the tensors are checked, and a refused update must change nothing."""
    before = backend.trainer_recipe
    try:
        yield
    except BaseException:
        backend.trainer_recipe = before
        raise


def refuse_after_failed_update(backend, holder: str) -> None:
    """``generate`` after a weight update that failed part-way (``backend.failed_update`` says why; its tensors not
    sent again since in ``backend._unsent``): refused, naming what to send. ``holder``: "model" or "engine"."""
    if backend.failed_update is None:
        return
    unsent = sorted(backend._unsent)
    raise RuntimeError(f"{backend.failed_update}; the {holder} may hold part of those weights under "
                       f"policy_version={backend.policy_version}, so no sample of it is a sample of one policy: "
                       f"send the full weights again (update_weights; {len(unsent)} tensor(s) of the failed "
                       f"update not sent since, e.g. {unsent[:3]}) before generating")
