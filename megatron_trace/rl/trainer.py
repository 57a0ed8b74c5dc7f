"""The trainer side of the demo: a Megatron-Core GPTModel (TRACE spec when the arm quantizes) + AdamW.

Loaded from a HF checkpoint directory through the bridge (the same path as a real pretrained
checkpoint); bf16 parameters with fp32 master weights in the optimizer, as Megatron's mixed
precision optimizer does. Megatron's parallel state must be initialised (world size 1 here).
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers

import torch

from ..config import TraceConfig
from ..rollout.base import check_temperature

logger = logging.getLogger(__name__)
_OWNER = "_megatron_trace_master_adamw"  # set on a parameter while a MasterAdamW's hook accumulates its gradient


class MasterAdamW:
    """AdamW on fp32 master copies of (bf16) parameters; the model keeps its own dtype.

    Gradients accumulate in fp32 on the master copies (Megatron's ``main_grad``): each backward's gradient of a
    parameter is added there as it is produced and the parameter's own ``.grad`` is freed, so micro-batches of one
    step sum in fp32 (with one micro-batch: the backward's gradient, as it was)."""

    def __init__(self, params, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999)):
        self.params = [p for p in params if p.requires_grad]
        owned = [tuple(p.shape) for p in self.params if getattr(p, _OWNER, False)]
        if owned:  # a second optimizer's hook would find the gradient already moved (and freed) by the first
            raise ValueError(f"{len(owned)} parameters (shapes {owned[:3]}...) already have a MasterAdamW: one "
                             "optimizer per parameter (build one over the model, or release() the old one first)")
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay, betas=betas)
        # each hook holds its master copy, never this optimizer: a hook is kept where autograd keeps it (C++), out of
        # reach of Python's cyclic GC, so one holding the optimizer (which holds the parameters) was never freed, its
        # master copies and AdamW states included, after the model and the optimizer were dropped (each demo arm's)
        self._hooks = [p.register_post_accumulate_grad_hook(lambda p, m=m: MasterAdamW._accumulate(p, m))
                       for p, m in zip(self.params, self.master)]
        for p in self.params:
            setattr(p, _OWNER, True)

    def release(self) -> None:
        """Detach from the parameters (their gradient hooks removed): another optimizer may then own them."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self.params:
            setattr(p, _OWNER, False)

    @staticmethod
    def _accumulate(p: torch.Tensor, m: torch.Tensor) -> None:
        if m.grad is None:
            m.grad = p.grad.float()
        else:
            m.grad.add_(p.grad)
        p.grad = None

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.master):
            p.grad = m.grad = None

    @torch.no_grad()
    def step(self, max_grad_norm: float | None = 1.0) -> float:
        """One AdamW step on the master copies, then copied into the parameters. ``max_grad_norm``: clip the fp32
        gradients to this global L2 norm first; ``None`` or ``0``: no clipping. Returns the norm before clipping."""
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not math.isfinite(max_grad_norm)
                                          or max_grad_norm < 0):
            # (a negative norm made clip_grad_norm_'s coefficient negative: every gradient flipped its sign)
            raise ValueError(f"max_grad_norm={max_grad_norm!r}: valid are None or 0 (no clipping) and finite "
                             "numbers > 0")
        grads = [m.grad for m in self.master if m.grad is not None]
        if max_grad_norm:
            norm = float(torch.nn.utils.clip_grad_norm_(self.master, max_grad_norm))
        else:  # (no gradient at all: norm 0, as clip_grad_norm_ gives; AdamW skips parameters without one)
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
                if grads else 0.0
        self.opt.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m.to(p.dtype))
        return norm

    def state_dict(self) -> dict:
        return {"opt": self.opt.state_dict(), "master": [m.detach().clone() for m in self.master]}

    def check_state_dict(self, sd: dict) -> None:
        """``sd`` (a ``state_dict``) fits this optimizer: its master weights' shapes, and AdamW's state of them (one
        parameter group of as many parameters; each moment of its master's shape: torch loads another shape as it is,
        and the next step fails on it). Raises naming what differs; sets nothing."""
        missing = [k for k in ("master", "opt") if k not in sd]
        if missing:
            raise ValueError(f"the optimizer state lacks {missing} (a MasterAdamW state has 'master' and 'opt'); "
                             "nothing loaded")
        got, want = [tuple(m.shape) for m in sd["master"]], [tuple(m.shape) for m in self.master]
        if got != want:  # (zip dropped the extra ones or left ours unloaded; copy_ broadcast a [4] into a [4, 4])
            bad = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
            raise ValueError(f"the optimizer state has {len(got)} master weights, this optimizer {len(want)}; the "
                             f"first that differs is #{bad} (state {got[bad] if bad < len(got) else None}, optimizer "
                             f"{want[bad] if bad < len(want) else None}): a state of other parameters; nothing loaded")
        groups = [list(g["params"]) for g in sd["opt"].get("param_groups", [])]
        ids = [i for g in groups for i in g]
        if len(groups) != 1 or len(ids) != len(want):
            raise ValueError(f"the optimizer state's AdamW has {len(groups)} parameter group(s) of "
                             f"{[len(g) for g in groups]} parameters, this optimizer 1 of [{len(want)}]; nothing "
                             "loaded")
        for n, i in enumerate(ids):
            for key, value in sd["opt"].get("state", {}).get(i, {}).items():
                if key != "step" and torch.is_tensor(value) and tuple(value.shape) != want[n]:
                    raise ValueError(f"the optimizer state's AdamW {key!r} of master weight #{n} is "
                                     f"{tuple(value.shape)}, its master {want[n]}; nothing loaded")

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        self.check_state_dict(sd)  # (all of it before any master is copied: AdamW's load could refuse after them)
        for m, s in zip(self.master, sd["master"]):
            m.copy_(s)
        self.opt.load_state_dict(sd["opt"])


class MegatronPolicy:
    """GPTModel + bridge + optimizer. ``quantized``: build with the TRACE spec for ``trace_config``."""

    def __init__(self, hf_dir: str, trace_config: TraceConfig, *, quantized: bool, lr: float,
                 dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
        from transformers import AutoConfig

        from ..bridge import Qwen3MoeBridge, build_gpt_model, load_hf_checkpoint, local_layer_spec

        hf_config = AutoConfig.from_pretrained(hf_dir)
        self.hf_config = hf_config
        self.bridge = Qwen3MoeBridge(hf_config, dtype=dtype, moe_enable_routing_replay=True)
        spec = local_layer_spec(hf_config)
        self.quantized = quantized
        self.trace_config = trace_config
        if quantized:
            from ..megatron import trace_spec

            spec = trace_spec(spec, trace_config)
        self.model = build_gpt_model(hf_config, self.bridge.config, spec=spec)
        load_hf_checkpoint(self.model, hf_dir, self.bridge)
        self.model.to(device=device, dtype=dtype)  # all parameters in the training dtype (as Float16Module)
        if quantized:  # .to() gave each parameter its own storage: the experts' weights side by side again
            from ..megatron.experts import TraceSequentialMLP

            for m in self.model.modules():
                if isinstance(m, TraceSequentialMLP):
                    m.pack_weights()
        self.optimizer = MasterAdamW(self.model.parameters(), lr=lr)

    def logprobs(self, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """log pi(tokens[b, t] | tokens[b, :t]) at the sampling ``temperature`` (logits / T; T = 0, greedy: T = 1,
        the rollout's convention) for t >= 1, float32 [B, S] (0 at t = 0)."""
        return token_logprobs(self.model(*model_inputs(tokens)), tokens, temperature)

    def forward_backward(self, tokens: torch.Tensor, micro_batch_size: int, loss_of, *, temperature: float = 1.0,
                         before_forward=None) -> torch.Tensor:
        """One training step's forward and backward through Megatron's ``forward_backward_func`` over the
        micro-batches of ``micro_batch_size`` rows of ``tokens`` [B, S] (B a multiple of it), in order.

        ``loss_of(i, logp_i, rows_i)``: micro-batch ``i``'s share of the batch loss from its log-probs (as
        ``logprobs``; rows_i: its slice of the batch); the shares add up to the batch loss (the schedule divides
        each micro-batch's loss by their number: it is multiplied back here). ``before_forward(i)`` runs before
        micro-batch i's forward (a stock model's routing replay). Returns the log-probs [B, S], detached.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        b, s = tokens.shape
        if micro_batch_size < 1 or b % micro_batch_size:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1 and divide the batch's {b} rows")
        rows = batch_slices(b, micro_batch_size)
        n, out = len(rows), [None] * len(rows)

        def forward_step(data_iterator, model):
            i = next(data_iterator)
            part = tokens[rows[i]]
            if before_forward is not None:
                before_forward(i)

            def loss_func(logits):
                lp = token_logprobs(logits, part, temperature)
                out[i] = lp.detach()
                return loss_of(i, lp, rows[i]) * n, {}

            return model(*model_inputs(part)), loss_func

        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(range(n)), model=[self.model],
                                    num_microbatches=n, seq_length=s, micro_batch_size=micro_batch_size,
                                    forward_only=False)
        return torch.cat(out)

    def export_hf_weights(self):
        from ..bridge import export_hf_weights

        return export_hf_weights(self.model, self.bridge)

    def state_dict(self) -> dict:
        return {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items() if v is not None},
                "optimizer": self.optimizer.state_dict(), "hf_config": self.hf_config.to_dict()}

    def load_state_dict(self, sd: dict, where: str = "the checkpoint") -> None:
        """Every weight and master copy of ``state_dict``'s model, checked (names, shapes; the model config, where the
        checkpoint has it: a top-k or RoPE theta of another config has no shape) before any is copied: a checkpoint of
        another model must not leave part of this one loaded."""
        from ..bridge.config import check_checkpoint_config

        want = {k: tuple(v.shape) for k, v in self.model.state_dict().items() if v is not None}
        got = {k: tuple(v.shape) for k, v in sd["model"].items() if v is not None}
        bad = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        if bad:
            raise ValueError(f"checkpoint of another model: {len(bad)} weight(s) missing, extra or of another shape, "
                             f"e.g. {bad[0]} (checkpoint {got.get(bad[0])}, model {want.get(bad[0])}); nothing was "
                             "loaded")
        try:  # (the optimizer's state, all of it, before the model: AdamW's load refused after the weights were set)
            self.optimizer.check_state_dict(sd["optimizer"])
        except ValueError as e:
            raise ValueError(f"{where}: {e} (nor the model)") from e
        if "hf_config" in sd:  # (older checkpoints have none)
            check_checkpoint_config(self.hf_config, type(self.hf_config).from_dict(sd["hf_config"]), where)
        self.model.load_state_dict(sd["model"], strict=True)
        self.optimizer.load_state_dict(sd["optimizer"])


def batch_slices(rows: int, micro_batch_size: int | None) -> list[slice]:
    """The row slices of the micro-batches of ``micro_batch_size`` rows (None or 0: one) of a batch of ``rows``
    (the last one shorter where it does not divide ``rows``)."""
    if micro_batch_size is not None and (isinstance(micro_batch_size, bool) or not isinstance(
            micro_batch_size, numbers.Integral) or micro_batch_size < 0):
        raise ValueError(f"micro_batch_size={micro_batch_size!r} must be None or an int >= 0 (0: the whole batch)")
    mbs = micro_batch_size or rows
    return [slice(i, i + mbs) for i in range(0, rows, mbs)]


def model_inputs(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTModel's (input ids, position ids, causal mask; True = masked) for unpadded-left batches [B, S]."""
    b, s = tokens.shape
    pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return tokens, pos, torch.ones(1, 1, s, s, dtype=torch.bool, device=tokens.device).triu(1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each next token (``MegatronPolicy.logprobs``): float32 [B, S], 0 at t = 0.
    ``temperature``: the rollout's (``SamplingParams.temperature``: 0, greedy, scores at T = 1)."""
    temperature = check_temperature(temperature)  # (a negative or NaN one scored at T = 1, an infinite one uniform)
    if logits.dim() != 3 or tokens.dim() != 2 or tuple(tokens.shape) != tuple(logits.shape[:2]) or \
            tokens.is_floating_point() or tokens.dtype == torch.bool:
        # (gather took tokens of fewer rows or positions than the logits: log-probs of other positions, silently)
        raise ValueError(f"tokens must be integer ids [B, S] of the logits' {tuple(logits.shape[:2])} (logits "
                         f"[B, S, V] {tuple(logits.shape)}), got {tokens.dtype} {tuple(tokens.shape)}")
    tokens = tokens.to(logits.device)
    scaled = logits[:, :-1].float() / (temperature or 1.0)
    lp = torch.log_softmax(scaled, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


@contextlib.contextmanager
def replay_routing(model, routing: dict[int, torch.Tensor] | None = None):
    """Routing replay for a stock (non-TRACE) Megatron MoE model through Megatron's RouterReplay.

    ``routing[layer]``: int64 [B, S, topk] (the rollout's choices); keyed by the MoE layer's own
    number (``layer_number - 1``), never by list position. TP = 1 (tokens in Megatron's [S, B] order).
    Yields ``replay(routing)``, which sets the indices of the next forward (a micro-batch's: call it before each
    one); ``routing`` given here is set at entry. An empty ``routing`` replays nothing.
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = {m.layer_number - 1: m.router for m in model.modules() if isinstance(m, MoELayer)}

    def replay(routing: dict[int, torch.Tensor] | None) -> None:
        if not routing:  # the next forward routes itself
            clear()
            return
        missing = sorted(set(routers) - set(routing))
        if missing:
            raise ValueError(f"routing indices are missing for MoE layers {missing}")
        for layer, router in routers.items():
            idx = routing[layer].transpose(0, 1).reshape(-1, routing[layer].shape[-1])  # [S*B, topk]
            router.router_replay.set_target_indices(idx)
            # (its backward list, which set_target_indices appends to, is not read with REPLAY_FORWARD: it would
            # keep every micro-batch's indices until the context exits)
            router.router_replay.replay_backward_list.clear()
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def clear() -> None:
        for router in routers.values():
            if router.router_replay is not None:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    try:
        replay(routing)
        yield replay
    finally:
        clear()
