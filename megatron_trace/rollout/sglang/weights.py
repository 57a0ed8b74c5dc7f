"""Weight sync into a running SGLang engine: HF names, BF16 or packed NVFP4 experts.

``engine_tensors`` turns the bridge's stream (HF name -> tensor | FP4Tensor) into the tensors SGLang's
model ``load_weights`` understands: an FP4 routed-expert Linear becomes its ModelOpt tensors
(``weight`` uint8, ``weight_scale`` e4m3, ``weight_scale_2`` f32) plus the exact
``weight_global_amax``. They are sent either in-process (``update_weights_from_tensor`` with
``load_format=WEIGHT_LOADER``, i.e. ``load_and_postprocess``) or over an NCCL group created like
slime's (``WeightsUpdateGroup``: trainer rank 0 + the engine's TP ranks; ``update_weights_from_distributed``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterable
from datetime import timedelta

import torch

from ...formats import FP4Tensor
from ...formats.nvfp4 import decode_scale_from_amax
from ..hf_weights import parse_expert_name

logger = logging.getLogger(__name__)


def engine_tensors(named: Iterable[tuple[str, torch.Tensor | FP4Tensor]], dtype: torch.dtype = torch.bfloat16,
                   bf16_layers: Collection[int] = (), fp4_layers: Collection[int] = ()
                   ) -> list[tuple[str, torch.Tensor]]:
    """HF-named values -> (name, tensor) pairs for SGLang's ``load_weights`` (no input_scale: kept as loaded).

    ``bf16_layers``: layers whose experts the engine serves in BF16 (``TraceConfig.exclude_modules``):
    FP4 values for them are an error (send BF16, e.g. ``bridge.fp4_stream(..., bf16_layers=...)``).
    ``fp4_layers``: layers whose experts the engine holds as packed NVFP4: BF16 values for them are an error
    (the engine's expert parameters are uint8; send ``bridge.fp4_stream``'s FP4 values)."""
    out = []
    for name, value in named:
        if not isinstance(value, FP4Tensor):
            parsed = parse_expert_name(name)
            if parsed is not None and parsed[0] in fp4_layers:
                raise ValueError(f"{name!r}: the engine holds layer {parsed[0]}'s routed experts as packed NVFP4; "
                                 "send FP4 values (bridge.fp4_stream), not BF16")
            t = value.detach()
            out.append((name, t.to(dtype) if t.is_floating_point() else t))
            continue
        parsed = parse_expert_name(name)
        if parsed is None:
            raise ValueError(f"{name!r}: FP4 values are accepted for routed-expert weights only")
        if parsed[0] in bf16_layers:
            raise ValueError(f"{name!r}: TraceConfig.exclude_modules keeps layer {parsed[0]}'s experts in BF16 in "
                             "the engine; send its BF16 weights")
        if value.fmt != "nvfp4" or value.global_amax is None or value.global_amax.dim() != 0:
            raise ValueError(f"{name!r}: expected NVFP4 with a per-tensor global amax, got {value.fmt} "
                             f"amax shape {None if value.global_amax is None else tuple(value.global_amax.shape)}")
        p = name.removesuffix(".weight")
        out += [(f"{p}.weight", value.codes), (f"{p}.weight_scale", value.block_scales),
                (f"{p}.weight_scale_2", decode_scale_from_amax(value.global_amax).reshape(())),
                (f"{p}.weight_global_amax", value.global_amax.float().reshape(()))]
    return out


def load_and_postprocess(model: torch.nn.Module, named_tensors) -> None:
    """``--custom-weight-loader`` entry: ``model.load_weights`` then re-run the post-processing of
    TRACE modules whose method derives tensors from the raw weights (native NVFP4 path), in place."""
    model.load_weights(named_tensors)
    n = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "native", False) and hasattr(method, "quant_config"):
            method.process_weights_after_loading(module)
            n += 1
    logger.info("TRACE weight load: %d tensors, %d modules post-processed", len(named_tensors), n)


def _new_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout: timedelta):
    """The same rendezvous SGLang's ``init_custom_process_group`` does (tcp store, PrefixStore(group_name))."""
    from torch.distributed import distributed_c10d as c10d

    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                           group_name=group_name, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def engine_group_ranks(server_args, tp_size: int | None = None) -> int:
    """How many engine ranks join the weight-update group, from the engine's ``server_args``.

    SGLang 0.5.10 numbers a scheduler's rank in the group ``rank_offset + tp_rank`` (``ModelRunner.
    init_weights_update_group``): the ranks of one tensor-parallel group, ``tp_size`` of them. Several pipeline stages
    (``pp_size``), or data-parallel replicas without DP attention (``dp_size``), would each bring ranks 1..tp again
    (SGLang's tokenizer asserts the latter, but only after the trainer waited out the rendezvous): refused here, before
    any process group is made. With ``enable_dp_attention`` the DP ranks are the TP ranks (1..tp_size, as counted).
    ``tp_size``, where given, must equal the engine's."""
    pp = getattr(server_args, "pp_size", 1)
    if pp != 1:
        raise ValueError(f"a weight-update group needs the engine's pp_size=1, got {pp}: SGLang numbers each engine "
                         "rank rank_offset + tp_rank, so every pipeline stage would claim ranks 1..tp_size")
    dp = getattr(server_args, "dp_size", 1)
    if dp != 1 and not getattr(server_args, "enable_dp_attention", False):
        raise ValueError(f"a weight-update group needs the engine's dp_size=1 or enable_dp_attention=True, got "
                         f"dp_size={dp} without DP attention: each replica would claim ranks 1..tp_size (SGLang's "
                         "init_weights_update_group refuses it)")
    engine_tp = getattr(server_args, "tp_size", 1)
    if tp_size is not None and tp_size != engine_tp:
        raise ValueError(f"tp_size={tp_size} but the engine's server_args.tp_size is {engine_tp}: the group would "
                         f"wait for {1 + tp_size} ranks and {1 + engine_tp} would come (leave tp_size out to take "
                         "the engine's)")
    return engine_tp


class WeightsUpdateGroup:
    """Trainer-side end of the weight-update group (rank 0; the engine's TP ranks are 1..tp).

    ``tp_size``: None takes the engine's ``server_args.tp_size`` (checked by ``engine_group_ranks``); an engine
    object without ``server_args`` (not an ``sglang.Engine``) needs it given."""

    def __init__(self, engine, *, master_address: str, master_port: int, tp_size: int | None = None,
                 group_name: str = "trace_weights", backend: str = "nccl", timeout_s: float = 600.0):
        self.engine, self.group_name = engine, group_name
        self.timeout = timedelta(seconds=timeout_s)
        server_args = getattr(engine, "server_args", None)
        if server_args is not None:
            tp_size = engine_group_ranks(server_args, tp_size)
        elif tp_size is None:
            raise ValueError(f"{type(engine).__name__} has no server_args to read the engine's tp_size from: pass "
                             "tp_size (the number of engine ranks joining the group)")
        world = 1 + tp_size
        t = _call_async(engine.init_weights_update_group, master_address=master_address, master_port=master_port,
                        rank_offset=1, world_size=world, group_name=group_name, backend=backend)
        self.group = _new_group(master_address, master_port, 0, world, group_name, backend, self.timeout)
        _join(t, self.timeout, "init_weights_update_group")

    def send(self, named: list[tuple[str, torch.Tensor]], *, flush_cache: bool = True) -> None:
        """Broadcast ``named`` (from ``engine_tensors``, on this rank's device) into the engine, in order."""
        names = [n for n, _ in named]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
        shapes = [list(t.shape) for _, t in named]
        t = _call_async(self.engine.update_weights_from_distributed, names=names, dtypes=dtypes, shapes=shapes,
                        group_name=self.group_name, flush_cache=flush_cache)
        for _, tensor in named:
            torch.distributed.broadcast(tensor.contiguous(), src=0, group=self.group)
        _join(t, self.timeout, "update_weights_from_distributed")


def _call_async(fn, **kw) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        try:
            box["result"] = fn(**kw)
        except BaseException as e:  # re-raised in _join
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def _join(t, timeout: timedelta, what: str):
    th, box = t
    th.join(timeout.total_seconds())
    if th.is_alive():
        raise TimeoutError(f"engine.{what} did not finish within {timeout.total_seconds():.0f} s")
    if "error" in box:
        raise box["error"]
    result = box.get("result")
    if isinstance(result, tuple) and result and result[0] is False:
        raise RuntimeError(f"engine.{what} failed: {result[1] if len(result) > 1 else result}")
    return result
