"""The GRPO driver: rollout -> reward -> advantages -> Megatron train step (guided) -> weight sync.

It is the reference integration of the plugin (how verl or slime would wire it), kept small:
one process, the rollout engine (hf backend) beside the Megatron trainer. Per step:

  1. the rollout samples G responses per prompt with FP4 numerics and records, per layer, its
     expert choices and its FP4 outcome (full codes on every layer: the superset the metrics need);
  2. the arm keeps what TRACE would ship (its layers; mantissa bits in compact mode), which goes
     through the guidance cache (split per sample, stored, assembled for the micro-batch: records
     whose token hash or version does not match are rejected and counted);
  3. the trainer recomputes log-probs with routing replay and guided rounding through Megatron's
     ``forward_backward_func`` (``micro_batch_size`` rows per micro-batch, each with its own assembled
     guidance, under one ``trace_guidance`` context), takes one PPO-clip step with the truncated IS
     correction, and records its own codes for the metrics;
  4. the new weights go to the rollout (packed FP4 experts for FP4 rollouts).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ACTIVATION_SITES, KV_SITES, OPERATIONAL_FIELDS
from ..guidance.records import pack_guidance, payload_of, with_tensors
from ..guidance.site import FallbackCounter, SiteGuidance
from ..metrics import cache_metrics, guidance_step_metrics, quant_counts, quant_metrics
from ..monitor import (
    SentinelCheck,
    SentinelError,
    TrendAlarm,
    check_mismatch_gate,
    step_mismatch_metrics,
)
from ..rollout.base import SamplingParams
from .arms import Arm
from .grpo import group_advantages, policy_loss
from .settings import RLConfig
from .tasks import CharTokenizer, Task, response_rewards
from .trainer import batch_slices

logger = logging.getLogger(__name__)

SENTINEL_STEP = -1  # the guidance cache's step id of the sentinel's own records (dropped after use)
PROMPT_SALT, SAMPLE_SALT, TRAINER_SALT = 100003, 7919, 104729  # a step's prompts, its rollout's and trainer's draws


def step_seed(seed: int, step: int, salt: int) -> int:
    """The seed of one of a step's random streams (``salt``): ``seed * salt + step`` modulo 2**63, the range of torch's
    generators and ``SamplingParams.seed`` (a large RLConfig.seed, e.g. 2**50, overflowed them at the first step, after
    the whole setup: 'Overflow when unpacking long long'); the same as without the modulo below ~8e13."""
    return (seed * salt + step) % 2**63


@dataclass
class ArmState:
    step: int = 0
    version: int = 0
    history: dict = field(default_factory=dict)  # the trend alarm's window (``TrendAlarm.state_dict``)


def keep_for_arm(full: dict, arm: Arm, num_layers: int) -> dict:
    """What TRACE ships for this arm: its guided layers and sites, compact or full."""
    from ..guidance.selection import guided_layers

    if not arm.guided:
        return {}
    layers = set(guided_layers(arm.trace, num_layers))
    compact = arm.trace.cache_mode == "compact"
    out = {}
    for (layer, site), sg in full.items():
        if layer in layers and site in arm.trace.guided_sites:
            rec = sg.record.to_compact() if compact else sg.record
            out[(layer, site)] = SiteGuidance(record=rec, valid=sg.valid, expert_ids=sg.expert_ids)
    return out


class GRPORun:
    """One arm: a rollout backend, a Megatron policy, the guidance cache and the loop."""

    def __init__(self, arm: Arm, cfg: RLConfig, task: Task, hf_dir: str, *, out_dir: Path, cache_dir: Path,
                 device: str = "cpu"):
        from ..guidance.cache import GuidanceCache
        from ..rollout.hf import HFRolloutBackend
        from .trainer import MegatronPolicy

        self.arm, self.cfg, self.task, self.tok = arm, cfg, task, CharTokenizer()
        self.out_dir = Path(out_dir)
        # the metrics' superset: full records of every quantized activation site at every layer (keep_for_arm ships
        # the arm's own; the quant/* metrics of its unguided sites compare the trainer's codes with these)
        record_cfg = arm.trace.replace(guided_layers="all", cache_mode="full",
                                       guided_sites=tuple(s for s in ACTIVATION_SITES if s in arm.trace.sites))
        self.rollout = HFRolloutBackend(hf_dir, mode=arm.rollout_mode, trace_config=record_cfg, device=device,
                                        fast_kv_attention=cfg.fast_kv_attention, compile=cfg.compile_rollout,
                                        static_decode=cfg.static_decode)
        self.policy = MegatronPolicy(hf_dir, arm.trace, quantized=arm.trainer_fp4, lr=cfg.lr, device=device)
        self.num_layers = self.policy.hf_config.num_hidden_layers
        self.cache = GuidanceCache(int(arm.trace.cache_budget_mb * 2**20), cache_dir)
        self.state = ArmState()
        self.last_metrics: dict | None = None  # the last step's row, also when it failed the sentinel or gate
        self.trend = TrendAlarm(window=cfg.trend_window, mode=cfg.trend_mode, max_growth=cfg.trend_max_growth,
                                max_slope=cfg.trend_max_slope, min_level=cfg.trend_min_level)
        from megatron.core import parallel_state as ps

        self.topology = {
            "tp": ps.get_tensor_model_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
        }
        self.sentinel = None
        if cfg.sentinel_prompts:
            g = torch.Generator().manual_seed(987654)
            prompts = [self.tok.encode(task.sample(g).prompt, bos=True) for _ in range(cfg.sentinel_prompts)]
            self.sentinel = SentinelCheck(prompts, max_new_tokens=task.answer_len + 1,
                                          max_abs_diff=cfg.sentinel_max_abs_diff)
        # FP4 experts' weights travel packed; a rollout that keeps them BF16 (sites without "weights", e.g. an FP4
        # KV cache alone) takes BF16 weights (fp4 raised a misleading "FP4 weights need mode='fp4'" at startup)
        fp4_weights = arm.rollout_mode == "fp4" and arm.trace.quantizes("weights")
        if cfg.weight_sync == "fp4" and not fp4_weights:
            raise ValueError(f"RLConfig.weight_sync='fp4' sends packed FP4 expert weights, but arm {arm.name!r} "
                             f"(rollout {arm.rollout_mode}, TraceConfig.sites={arm.trace.sites}) keeps them BF16: use "
                             "weight_sync='auto' or 'bf16'")
        self.sync_fmt = ("fp4" if fp4_weights else "bf16") if cfg.weight_sync == "auto" else cfg.weight_sync
        self.recipe = None
        if arm.trainer_fp4:  # both sides run FP4: the quant-recipe manifest must agree, now and on every sync
            from ..manifest import trainer_recipe
            from ..megatron import find_trace_layers

            self.recipe = trainer_recipe(find_trace_layers(self.policy.model))
            # the demo's rollout records every layer in full mode (the metrics' superset) on purpose
            self.rollout.check_recipe(self.recipe, ignore=("guided_layers", "guided_sites", "cache_mode"))
        # a sync that raised, which the next step() retries before its rollout: "step" (a step's, after it trained) or
        # "reset" (the startup's or a resume's, which may set the version back); None: the rollout serves state.version
        self._sync_pending: str | None = None
        # the rollout serves exactly the trainer's weights (and FP4 codes) of version 0: the checkpoint both loaded
        self._reset_sync()

    # ---- pieces ----------------------------------------------------------------------------
    def _reset_sync(self) -> None:
        """Set the rollout to the trainer's weights and version (startup, resume), then run the sentinel, as after
        every sync: a bridge or recipe fault shows before the first step, not after it."""
        self._sync_pending = "reset"
        self._sync_weights(reset=True)
        self._sync_pending = None
        if self.sentinel is not None:
            self.sentinel.run(self.rollout, self._sentinel_logprobs)  # (logged; SentinelError above its bound)

    def _sync_weights(self, reset: bool = False) -> dict:
        """The trainer's weights to the rollout as ``state.version``: a step's sync raises unless that is newer than
        the rollout's; ``reset`` (the first sync, a resume) sets it whatever the rollout served, no guidance kept."""
        from ..bridge import sync_weights

        v = self.state.version
        dtype = torch.bfloat16 if self.recipe is None else getattr(torch, self.recipe.dtype)  # (the trainer's own)
        stats = sync_weights(self.rollout, self.policy.export_hf_weights(), fmt=self.sync_fmt, dtype=dtype,
                             quantizer=self.arm.trace.weight_quantizer(), version=v, reset=reset,
                             bf16_layers=getattr(self.rollout, "bf16_expert_layers", ()), kernel=self.arm.trace.kernel,
                             recipe=None if self.recipe is None else self.recipe.with_weight_version(v))
        return stats.as_dict()

    def _prompts(self, step: int):
        g = torch.Generator().manual_seed(step_seed(self.cfg.seed, step, PROMPT_SALT))
        problems = [self.task.sample(g) for _ in range(self.cfg.prompts_per_step)]
        problems = [p for p in problems for _ in range(self.cfg.group_size)]
        return problems, [self.tok.encode(p.prompt, bos=True) for p in problems]

    def _sampling(self, step: int, temperature: float) -> SamplingParams:
        return SamplingParams(temperature=temperature, max_new_tokens=self.task.answer_len + 1,
                              stop_token_ids=(self.tok.eos_id,), seed=step_seed(self.cfg.seed, step, SAMPLE_SALT))

    def evaluate(self) -> float:
        """Held-out greedy accuracy with the rollout's numerics (fixed problems, seed 123456)."""
        g = torch.Generator().manual_seed(123456)
        problems = [self.task.sample(g) for _ in range(self.cfg.eval_problems)]
        batch = self.rollout.generate([self.tok.encode(p.prompt, bos=True) for p in problems], self._sampling(0, 0.0))
        return sum(self._rewards(problems, batch)) / len(problems)

    def _rewards(self, problems, batch) -> list[float]:
        return response_rewards(self.task, self.tok, problems, batch.responses())

    def _guidance(self, step: int, batch, full: dict, micro_batch_size: int | None = None):
        """Ship the arm's records through the cache and assemble them per trainer micro-batch (of
        ``micro_batch_size`` rows; None: one): (a ``StepGuidance`` for each, in order, the assembly's counter, the
        ``cache/*`` bytes-per-token metrics)."""
        from ..megatron import StepGuidance

        keep = keep_for_arm(full, self.arm, self.num_layers)
        counter = FallbackCounter()
        mask = batch.attention_mask
        # either switch turns R3 off for every arm (a stock model's replay never reads TraceConfig.routing_replay)
        routing = batch.routing if self.cfg.routing_replay and self.arm.trace.routing_replay else {}
        if micro_batch_size and mask.shape[0] % micro_batch_size:
            raise ValueError(f"micro_batch_size={micro_batch_size} must divide the batch's {mask.shape[0]} rows")
        rows = batch_slices(mask.shape[0], micro_batch_size)

        def part(sl: slice, sites: dict) -> StepGuidance:
            return StepGuidance(sites=sites, routing={k: v[sl] for k, v in routing.items()}, token_mask=mask[sl])

        if not keep:
            return [part(sl, {}) for sl in rows], counter, cache_metrics(0.0, 0.0)
        packed = pack_guidance(keep, batch.tokens, version=batch.policy_version, attention_mask=mask)
        # a step that raised after storing its records (e.g. in training) left them held: this retry stores its own
        self.cache.invalidate(step)
        self.cache.put(step, packed)  # device -> host (columns, or per sample and spilled beyond the budget)
        ids, tokens, host_mask = list(packed.table.ids), batch.tokens.cpu(), mask.cpu()
        if batch.policy_version != self.state.version:  # e.g. the last sync failed: the rollout kept older weights
            logger.warning("step %d: the rollout served version %d, the trainer holds version %d: its guidance is "
                           "rejected (guidance/assembly/fallback/version), the trainer rounds on its own",
                           step, batch.policy_version, self.state.version)
        # the version the records must carry is the trainer's own (the weights it recomputes with), not the batch's
        steps = [part(sl, self.cache.assemble(step, ids[sl], tokens[sl], versions=self.state.version,
                                              counter=counter, attention_mask=host_mask[sl])) for sl in rows]
        tokens = max(int(mask.sum()), 1)
        nbytes = packed.guidance_nbytes()
        # the same records with full codes: a full row's payload is 4 bits per element, a compact row's 1 (both of
        # the block-padded row), scales and amax unchanged
        full_nbytes = nbytes + (3 * sum(c.fields["payload"].nbytes for c in packed.columns)
                                if self.arm.trace.cache_mode == "compact" else 0)
        return steps, counter, cache_metrics(nbytes / tokens, full_nbytes / tokens)

    def _quant_metrics(self, recorded: list, full: dict, micro_batch_size: int) -> dict:
        """The trainer's recorded codes (one ``StepGuidance`` per micro-batch) against the rollout's full records."""
        counts, guided = {}, None
        guided_keys = set(keep_for_arm(full, self.arm, self.num_layers))
        for rec, sl in zip(recorded, batch_slices(micro_batch_size * len(recorded), micro_batch_size)):
            for key, sg in rec.sites.items():
                if key in full and not sg.compact:
                    want = batch_rows(full[key], sl)
                    rows = want.valid & sg.valid
                    if sg.expert_ids is not None and want.expert_ids is not None:  # FC2: a slot of another expert
                        rows &= sg.expert_ids == want.expert_ids  # (routing replay off) holds other rows
                    c = quant_counts(sg.record, want.record, rows=rows)
                    counts[key] = c if key not in counts else counts[key] + c
                    if key in guided_keys:
                        guided = c if guided is None else guided + c
        out = quant_metrics(counts)
        if guided is not None:
            out.update({f"quant/guided/{k}": v for k, v in guided.rates().items()})
        return out

    def _trainer_context(self, sg, record: bool = False):
        """Guided rounding + routing replay (TRACE spec: ``sg`` one StepGuidance or one per micro-batch) or routing
        replay alone (stock spec: ``sg``'s routing is set at entry; the context yields ``replay(routing)``)."""
        from ..megatron import StepGuidance, trace_guidance
        from .trainer import replay_routing

        if self.arm.trainer_fp4:
            return trace_guidance(self.policy.model, sg, record=record, compact=False)
        return replay_routing(self.policy.model, sg.routing if isinstance(sg, StepGuidance) else None)

    def _weight_quant_once(self, micro_batches: int):
        """FP4 QAT over several micro-batches: the experts' weights fake-quantized once for all of them (same
        gradients bit for bit; ``reuse_weight_quant``)."""
        from ..megatron import reuse_weight_quant

        if self.arm.trainer_fp4 and micro_batches > 1 and not self.arm.trace.ste_clip:
            return reuse_weight_quant(self.policy.model)
        return contextlib.nullcontext()

    def _sentinel_logprobs(self, batch) -> torch.Tensor:
        """The trainer's log-probs of the sentinel rollout, guided by that rollout's own records: what the arm
        computes in training (and its fallback / coverage settings hold)."""
        try:
            (sg,), _, _ = self._guidance(SENTINEL_STEP, batch, batch.guidance)
            with torch.no_grad(), self._trainer_context(sg):
                return self.policy.logprobs(batch.tokens)
        finally:
            self.cache.drop(SENTINEL_STEP)

    def train_pass(self, batch, adv: torch.Tensor, steps: list, *, record: bool = False):
        """The step's forward and backward: Megatron's schedule over one micro-batch per ``StepGuidance`` of
        ``steps`` (``_guidance``; their rows split the batch evenly), PPO-clip + TIS loss, gradients accumulated in
        the optimizer's fp32 master grads. Returns (log-probs [B, S] detached, the ``trace_guidance`` handle; for a
        stock model, its ``replay``)."""
        cfg, mask = self.cfg, batch.response_mask
        n_tokens, mbs = int(mask.sum()), batch.tokens.shape[0] // len(steps)
        if any(s.token_mask is None for s in steps):
            raise ValueError("every micro-batch's StepGuidance needs its token_mask (bool [rows, S]; "
                             "GRPORun._guidance sets it): it gives the micro-batch's rows")
        sizes = [s.token_mask.shape[0] for s in steps]
        if mbs * len(steps) != batch.tokens.shape[0] or sizes != [mbs] * len(steps):
            raise ValueError(f"the {len(steps)} micro-batches' guidance covers {sizes} rows: they must split the "
                             f"batch's {batch.tokens.shape[0]} rows evenly, in order (GRPORun._guidance)")

        def loss_of(i: int, lp: torch.Tensor, sl: slice) -> torch.Tensor:  # micro-batch i's share of the loss
            return policy_loss(lp, lp.detach(), batch.logprobs[sl], adv[sl], mask[sl], clip_eps=cfg.clip_eps,
                               tis_cap=cfg.tis_cap, num_tokens=n_tokens, stats=False)[0]  # (no host reads)

        self.policy.optimizer.zero_grad()
        with self._trainer_context(steps, record=record) as h, self._weight_quant_once(len(steps)):
            replay = None if self.arm.trainer_fp4 else (lambda i: h(steps[i].routing))  # stock: set per forward
            logp = self.policy.forward_backward(batch.tokens, mbs, loss_of, temperature=cfg.temperature,
                                                before_forward=replay)  # the rollout's log-probs are at T too
        return logp, h

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> dict:
        if self._sync_pending:  # the last step trained (or a resume loaded), then its sync raised: serve its weights
            logger.warning("step %d: retrying the weight sync to version %d that raised (%s sync)", self.state.step,
                           self.state.version, self._sync_pending)
            self._sync_weights(reset=self._sync_pending == "reset")
            self._sync_pending = None
        step, cfg, t0 = self.state.step, self.cfg, time.perf_counter()
        # the trainer's own random draws (TraceConfig.rounding="stochastic") are a function of (seed, step): a resumed
        # run redoes the step exactly
        torch.manual_seed(step_seed(cfg.seed, step, TRAINER_SALT))
        problems, prompt_ids = self._prompts(step)
        batch = self.rollout.generate(prompt_ids, self._sampling(step, cfg.temperature))
        t_roll = time.perf_counter()
        rewards = torch.tensor(self._rewards(problems, batch), device=batch.tokens.device)
        adv = group_advantages(rewards, cfg.group_size)
        full = batch.guidance
        t_guid = time.perf_counter()
        mbs = cfg.micro_batch_size or batch.tokens.shape[0]
        steps, counter, cache = self._guidance(step, batch, full, mbs)
        t_guid = time.perf_counter() - t_guid
        record = bool(self.arm.trainer_fp4 and cfg.quant_metrics_every and step % cfg.quant_metrics_every == 0)
        logp, h = self.train_pass(batch, adv, steps, record=record)
        with torch.no_grad():  # the batch's loss and stats (the micro-batches' shares add up to it)
            loss, stats = policy_loss(logp, logp, batch.logprobs, adv, batch.response_mask, clip_eps=cfg.clip_eps,
                                      tis_cap=cfg.tis_cap)
        grad_norm = self.policy.optimizer.step()
        # the step has trained: it counts from here (its metrics below may raise, e.g. an interrupt or a trend alarm
        # with raise_on_alarm, and a sync may), so a retry of step() syncs these weights first, never training the
        # same prompts twice on the stepped weights; its records are no longer needed
        self.state.version += 1
        self.state.step += 1
        self._sync_pending = "step"
        self.cache.drop(step)
        t_train = time.perf_counter()
        metrics = {"reward": float(rewards.mean()), "loss": float(loss), "grad_norm": grad_norm, **stats,
                   "trainer/micro_batches": float(len(steps))}
        # an FP4 KV cache holds K, V or both (sites=("kv_v",) alone is accepted): either splits prefill from decode
        kv_fp4 = self.arm.rollout_mode == "fp4" and any(self.arm.trace.quantizes(s) for s in KV_SITES)
        metrics.update(step_mismatch_metrics(logp, batch.logprobs, batch.response_mask, kv_quantized=kv_fp4,
                                             topology=None))
        metrics.update(self.trend.update(metrics, step))
        if self.arm.trainer_fp4:
            metrics.update(guidance_step_metrics(h.counter, h.stats(), prefix="guidance/trainer"))
            if record:
                recorded = [h.microbatch(i).recorded() for i in range(len(steps))]
                metrics.update(self._quant_metrics(recorded, full, mbs))
        metrics.update(counter.as_dict("guidance/assembly"))
        metrics.update(cache)
        t_sync = time.perf_counter()
        metrics.update(self._sync_weights())
        self._sync_pending = None
        t_sync = time.perf_counter() - t_sync
        t_sentinel, sentinel_error = time.perf_counter(), None
        if self.sentinel is not None:
            try:
                metrics.update(self.sentinel.run(self.rollout, self._sentinel_logprobs))
            except SentinelError as err:  # raised below, once the step's row is complete
                metrics.update(err.metrics)
                sentinel_error = err
        t_end = time.perf_counter()
        # time/sync_s is the weight sync alone: the sentinel's rollout and trainer pass are time/sentinel_s
        metrics.update({"time/step_s": t_end - t0, "time/rollout_s": t_roll - t0, "time/train_s": t_train - t_roll,
                        "time/guidance_s": t_guid, "time/sync_s": t_sync, "time/sentinel_s": t_end - t_sentinel,
                        "policy_version": float(self.state.version)})
        metrics.update({f"topology/{k}": float(v) for k, v in self.topology.items()})  # mismatch depends on it
        self.last_metrics = metrics  # (the row of a step that fails the sentinel or the gate below)
        if sentinel_error is not None:
            raise sentinel_error
        check_mismatch_gate(metrics, cfg.max_logprob_abs_diff)
        return metrics

    # ---- checkpoints -----------------------------------------------------------------------------
    def _run_identity(self) -> dict:
        return {"task": self.task.name, **{k: getattr(self.cfg, k) for k in RUN_FIELDS}}

    def save(self, path: Path) -> None:
        """Write the checkpoint beside ``path``, then move it there: a run killed while saving keeps the last one."""
        self.state.history = self.trend.state_dict()
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"policy": self.policy.state_dict(), "state": dataclasses.asdict(self.state),
                    "arm": self.arm.name, "trace": self.arm.trace.to_dict(), "run": self._run_identity()}, tmp)
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        """Resume: weights, optimizer, step and version; the rollout is re-synced, no cached guidance reused."""
        ck = torch.load(path, weights_only=False)
        trace, now = ck["trace"], self.arm.trace.to_dict()
        numeric = sorted((trace.keys() | now.keys()) - set(OPERATIONAL_FIELDS))
        diff = _differences(trace, now, numeric)  # (the fields that differ, named: there are two dozen)
        if ck["arm"] != self.arm.name or diff:
            other = "" if ck["arm"] == self.arm.name else f" (this run's arm is {self.arm.name!r})"
            raise ValueError(f"checkpoint {path} is for arm {ck['arm']!r}{other}" + (
                f" with another TraceConfig: {diff}" if diff else ""))
        if changed := _differences(trace, now, OPERATIONAL_FIELDS):
            logger.info("resuming %s with other operational TraceConfig fields: %s", path, changed)
        saved, now = ck.get("run", {}), self._run_identity()  # (older checkpoints have none)
        diff = _differences(saved, now, [k for k in now if k in saved])
        if diff:  # another run's data stream (or an optimizer whose loaded lr overrides the configured one)
            raise ValueError(f"checkpoint {path} is of another run: {diff}")
        # everything read and checked before anything is set: a checkpoint refused half-way (a state field this
        # version does not know, a damaged trend window) left its weights beside this run's step and version
        state = ArmState(**ck["state"])
        trend = copy.deepcopy(self.trend)
        if state.history:
            trend.load_state_dict(state.history)
        self.policy.load_state_dict(ck["policy"], where=f"checkpoint {path}")
        self.state, self.trend = state, trend
        # from here the rollout serves other weights than the trainer's until the reset sync succeeds: a resume that
        # raises below (a spilled shard that cannot be deleted, the sync itself) leaves it to the next step()
        self._sync_pending = "reset"
        self._invalidate_cache()
        self._reset_sync()  # the checkpoint's version, also below what this rollout served

    def _invalidate_cache(self) -> None:
        """Discard every cached step (none is of the loaded weights): each is tried, the failures (shards that could
        not be deleted, named) raised together once all are forgotten."""
        errors = []
        for step in self.cache.steps:
            try:
                self.cache.invalidate(step)
            except OSError as e:
                errors.append(str(e))
        if errors:
            raise OSError("resume: " + " | ".join(errors))


def _differences(saved: dict, now: dict, keys) -> str:
    """"k: checkpoint=.. now=.." for each of ``keys`` whose values differ (a missing one is None), "; "-joined."""
    return "; ".join(f"{k}: checkpoint={saved.get(k)!r} now={now.get(k)!r}" for k in keys if saved.get(k) != now.get(k))


RUN_FIELDS = ("seed", "prompts_per_step", "group_size", "lr", "clip_eps", "tis_cap", "kl_coef", "temperature",
              "routing_replay", "weight_sync")
"""The RLConfig fields a resumed run must share with its checkpoint (the others, e.g. steps, may change)."""


def batch_rows(sg: SiteGuidance, rows: slice) -> SiteGuidance:
    """``sg``'s records of batch rows ``rows`` (a micro-batch's; every tensor is batch-major, a per-tensor
    ``global_amax`` applies to all rows)."""
    r, amax = sg.record, sg.record.global_amax
    n = len(range(*rows.indices(r.shape[0])))
    rec = with_tensors(r, payload_of(r)[rows], r.block_scales[rows],
                       amax[rows] if amax is not None and amax.dim() else amax, (n, *r.shape[1:]))
    return SiteGuidance(record=rec, valid=sg.valid[rows],
                        expert_ids=None if sg.expert_ids is None else sg.expert_ids[rows])
