"""Guidance capture inside an SGLang scheduler process: rows stored per KV slot, read out per request.

Modelled on SGLang's routed-experts capturer (a buffer indexed by KV slot, gathered per request by
``req_to_token``), without its per-forward host copy:

  * bind: a forward hook on every ``RadixAttention`` (``model.layers.*.self_attn.attn``, called as
    ``attn(q, k, v, forward_batch)``) hands ``forward_batch.out_cache_loc`` (the KV slot of each
    token of this forward) to the capture before that layer's MoE runs. Under CUDA-graph capture
    this is the graph runner's static slot buffer, so replays index with the replay's slots;
  * write (inside forward, tensor ops only): the TRACE MoE method calls ``record(layer, site, q)``
    and the encoded rows [T, nbytes] go to ``slot_buffer.index_copy_(0, out_cache_loc, rows)``: no
    host sync, no per-request Python, replayed by CUDA graphs. The buffers are allocated at the
    first eager forward (SGLang warms up eagerly before capturing) with ``kv_pool.size +
    kv_pool.page_size`` rows like the KV pool (memory: that many rows times ``SiteSpec.nbytes`` per
    recorded (layer, site), outside SGLang's ``mem_fraction_static``);
  * KV sites need no buffer: SGLang's FP4 KV pool already holds each slot's packed codes and E8M0
    scales (``k_buffer`` / ``k_scale_buffer``), which are read as they are (``sglang_kvfp4``);
  * read out: a request whose rid starts with ``READOUT_PREFIX`` (the backend sends prompt +
    response again, ``max_new_tokens=1``) is a radix-cache hit on the finished request's slots; the
    forward hook on ``logits_processor`` (an eager extend forward) gathers the rows of its cached
    prefix by ``req_to_token[req_pool_idx, :prefix_len]`` and returns them in
    ``customized_info["trace_guidance"]`` -> ``meta_info``. A prefix shared by many samples (GRPO)
    is stored once in its slots and read out for each sample: the rows that produced the cached KV.

The capture itself is graph-safe; whether CUDA graphs can be on depends on the MoE method (the Hopper
emulation synchronizes with the host: ``launch.trace_server_args`` disables graphs there). Padded tokens
of a replayed graph write where SGLang writes their K/V (its dummy slot).

Rows that are not in a slot any more (evicted before the read-out, or positions beyond the matched
prefix, e.g. a page_size > 1 remainder) are not delivered: invalid, and the trainer counts them.
"""

from __future__ import annotations

import logging

import torch

from ...formats import FP4Tensor, sglang_kvfp4
from ...manifest import KV_SITES
from .records import SiteSpec, encode_rows

logger = logging.getLogger(__name__)

INFO_KEY = "trace_guidance"
READOUT_PREFIX = "trace-readout-"
ATTENTION_TARGET = "model.layers.*.self_attn.attn"
LOGITS_TARGET = "logits_processor"


class SlotCapture:
    """Per-process slot buffers of the selected (layer, site) pairs. ``num_slots`` None: sized at the first bind."""

    def __init__(self, specs: list[SiteSpec], num_slots: int | None = None, device: torch.device | str = "cpu"):
        self.specs = {s.key: s for s in specs}
        self.kv_specs = [s for s in specs if s.site in KV_SITES]
        bad = [s.key for s in self.kv_specs if s.fmt != sglang_kvfp4.NAME]
        if bad:
            raise ValueError(f"KV sites are read from SGLang's FP4 KV pool (fmt {sglang_kvfp4.NAME!r}); got {bad}")
        self.buffers: dict[tuple[int, str], torch.Tensor] = {}
        self._loc: torch.Tensor | None = None
        if num_slots is not None:
            self.allocate(num_slots, device)

    def allocate(self, num_slots: int, device) -> None:
        """One uint8 [num_slots, nbytes] buffer per selected expert site (zeros)."""
        self.buffers = {k: torch.zeros(num_slots, s.nbytes, dtype=torch.uint8, device=device)
                        for k, s in self.specs.items() if s.site not in KV_SITES}
        logger.info("TRACE slot capture: %d slots, %.1f MiB", num_slots, self.nbytes() / 2**20)

    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())

    def bind(self, out_cache_loc: torch.Tensor, num_slots: int | None = None) -> None:
        """The KV slots [T] of this forward's tokens (a reference: no copy, no sync)."""
        if not self.buffers and any(s.site not in KV_SITES for s in self.specs.values()):
            if num_slots is None:
                raise RuntimeError("TRACE slot capture: buffers not allocated and the KV pool size is unknown")
            if out_cache_loc.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("TRACE slot capture: first forward is a CUDA-graph capture; an eager forward "
                                   "must allocate the buffers first")
            self.allocate(num_slots, out_cache_loc.device)
        self._loc = out_cache_loc

    def wants(self, layer: int, site: str) -> bool:
        return (layer, site) in self.specs

    def record(self, layer: int, site: str, q: FP4Tensor) -> None:
        """Rows [T, *row_shape] quantized by this forward, written at their KV slots (tensor ops only)."""
        spec = self.specs.get((layer, site))
        if spec is None:
            return
        if self._loc is None:
            raise RuntimeError(f"{spec.key}: no KV slots bound (the attention forward hook is missing; launch with "
                               "launch.trace_server_args)")
        rows = encode_rows(q, spec)  # [T, nbytes]
        if rows.shape[0] != self._loc.shape[0]:
            raise RuntimeError(f"{spec.key}: {rows.shape[0]} rows but {self._loc.shape[0]} KV slots in this forward "
                               "(DP attention / sharded MoE inputs are not supported by the capture)")
        self.buffers[spec.key].index_copy_(0, self._loc.long(), rows)

    def gather(self, slots: torch.Tensor, kv_pool=None) -> dict[str, torch.Tensor]:
        """Rows of ``slots`` [n] (int, device) per site: wire key -> uint8 [n, nbytes] (device)."""
        idx = slots.long()
        out = {self.specs[k].wire_key: b.index_select(0, idx) for k, b in self.buffers.items()}
        for spec in self.kv_specs:
            out[spec.wire_key] = kv_rows(kv_pool, spec, idx)
        return out

    def request_payload(self, req_to_token: torch.Tensor, req_pool_idx: int, n: int, kv_pool=None) -> dict:
        """Positions [0, n) of a request (its slots ``req_to_token[req_pool_idx, :n]``) as host bytes."""
        slots = req_to_token[int(req_pool_idx), : int(n)]
        sites = {k: v.cpu().numpy().tobytes() for k, v in self.gather(slots, kv_pool).items()}
        return {"start": 0, "n": int(n), "sites": sites}


def kv_rows(kv_pool, spec: SiteSpec, slots: torch.Tensor) -> torch.Tensor:
    """SGLang ``MHATokenToKVPoolFP4`` rows of one layer's K or V at ``slots`` -> uint8 [n, spec.nbytes]."""
    if kv_pool is None or not hasattr(kv_pool, "k_scale_buffer"):
        raise RuntimeError(f"{spec.key}: KV guidance needs SGLang's FP4 KV pool (--kv-cache-dtype fp4_e2m1), got "
                           f"{type(kv_pool).__name__}")
    start = getattr(kv_pool, "start_layer", 0)
    i = spec.layer - start
    if not 0 <= i < len(kv_pool.k_buffer):  # (a negative index would read another layer from the end)
        raise RuntimeError(f"{spec.key}: layer {spec.layer} is not in this KV pool (layers {start} .. "
                           f"{start + len(kv_pool.k_buffer) - 1}): a pipeline stage reads out its own layers only")
    codes, scales = (kv_pool.k_buffer, kv_pool.k_scale_buffer) if spec.site == "kv_k" else \
        (kv_pool.v_buffer, kv_pool.v_scale_buffer)
    q = sglang_kvfp4.from_sglang(codes[i].index_select(0, slots).view(torch.uint8),
                                 scales[i].index_select(0, slots).view(torch.uint8))
    return encode_rows(q, spec)


_CAPTURE: SlotCapture | None = None


def active_capture() -> SlotCapture | None:
    """The capture of this process (set by the hook factories), or None."""
    return _CAPTURE


def set_capture(capture: SlotCapture | None) -> None:
    global _CAPTURE
    _CAPTURE = capture


def specs_from_config(config: dict) -> list[SiteSpec]:
    return [SiteSpec(int(s["layer"]), s["site"], tuple(s["row_shape"]), s.get("fmt", "nvfp4"),
                     bool(s.get("compact", True))) for s in config.get("specs", [])]


def _capture_for(config: dict) -> SlotCapture:
    """The process's capture for ``config`` (both hook factories get the same config: one capture)."""
    cap = active_capture()
    specs = specs_from_config(config)
    if cap is None or set(cap.specs) != {s.key for s in specs}:
        cap = SlotCapture(specs)
        set_capture(cap)
        logger.info("TRACE guidance capture: %d (layer, site) pairs", len(specs))
    return cap


def _forward_batch(args, where: str):
    fb = args[3] if len(args) > 3 else None
    if fb is None or not hasattr(fb, "out_cache_loc"):
        raise RuntimeError(f"TRACE {where} hook: expected a ForwardBatch as the 4th positional argument")
    return fb


def make_attention_hook(config: dict):
    """``--forward-hooks`` factory for ``RadixAttention``: binds this forward's KV slots to the capture."""
    cap = _capture_for(config)

    def hook(module, args, output):
        fb = _forward_batch(args, "attention")
        pool = fb.token_to_kv_pool
        num_slots = None if pool is None else int(pool.size) + int(getattr(pool, "page_size", 1))
        cap.bind(fb.out_cache_loc, num_slots)
        return output

    return hook


def readout_payloads(cap: SlotCapture, fb) -> list[dict | None] | None:
    """Per request of an extend ForwardBatch: the cached-prefix rows of read-out requests, None for others."""
    rids = getattr(fb, "rids", None)
    if rids is None or not fb.forward_mode.is_extend() or not any(str(r).startswith(READOUT_PREFIX) for r in rids):
        return None
    pool = fb.req_to_token_pool.req_to_token
    out: list[dict | None] = []
    for i, rid in enumerate(rids):
        if not str(rid).startswith(READOUT_PREFIX):
            out.append(None)
            continue
        n = int(fb.extend_prefix_lens_cpu[i])
        out.append(cap.request_payload(pool, int(fb.req_pool_indices[i]), n, fb.token_to_kv_pool))
    return out


def make_logits_hook(config: dict):
    """``--forward-hooks`` factory for ``logits_processor``: read-out of requests marked ``READOUT_PREFIX``."""
    cap = _capture_for(config)

    def hook(module, args, output):
        payloads = readout_payloads(cap, _forward_batch(args, "logits"))
        if payloads is not None:
            info = dict(output.customized_info or {})
            info[INFO_KEY] = payloads
            output.customized_info = info
        return output

    return hook
