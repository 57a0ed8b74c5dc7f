"""Guidance capture inside an SGLang scheduler process, returned per request in ``meta_info``.

Modelled on SGLang's routed-experts capturer, with the delivery SGLang already has for
per-request side data (``LogitsProcessorOutput.customized_info`` -> ``meta_info``):

  1. inside the forward, the TRACE MoE method calls ``record(layer, site, q)`` with the rows it
     quantized ([T, ...], T = tokens of this forward, in batch order);
  2. a forward hook on the model's ``logits_processor`` (registered by SGLang from
     ``--forward-hooks``, see ``hook_spec``) cuts this forward's rows per request (prefill: the
     extend tokens of each request; decode: one token each) and sets
     ``output.customized_info["trace_guidance"]`` to one payload per request
     ``{"start": first position, "n": rows, "sites": {"layer:site": bytes}}``;
  3. SGLang appends one payload per step to the request; ``records.assemble`` turns the list into
     ``SiteGuidance`` on the backend side.

Limits (documented, enforced by ``launch.trace_server_args``): needs ``--disable-cuda-graph`` (a
replayed graph runs no Python hook) and prompts prefilled in one chunk; prefix-cache hits are
not recomputed, so their rows are missing and marked invalid (the trainer falls back and counts
them) unless the radix cache is disabled.
"""

from __future__ import annotations

import logging

import torch

from ...formats import FP4Tensor
from .records import SiteSpec, encode_rows

logger = logging.getLogger(__name__)

INFO_KEY = "trace_guidance"


class GuidanceCapture:
    """Per-process store of this forward's encoded rows for the selected (layer, site) pairs."""

    def __init__(self, specs: list[SiteSpec]):
        self.specs = {s.key: s for s in specs}
        self._rows: dict[tuple[int, str], torch.Tensor] = {}

    def wants(self, layer: int, site: str) -> bool:
        return (layer, site) in self.specs

    def record(self, layer: int, site: str, q: FP4Tensor) -> None:
        """Rows [T, *row_shape] quantized by this forward (ignored unless the site is selected)."""
        spec = self.specs.get((layer, site))
        if spec is not None:
            self._rows[spec.key] = encode_rows(q, spec)  # [T, nbytes], stays on the device

    def payloads(self, starts: list[int], counts: list[int]) -> list[dict]:
        """Split this forward's rows per request (``counts`` rows each, first position ``starts``)."""
        total = sum(counts)
        host = {}
        for key, rows in self._rows.items():
            if rows.shape[0] < total:
                raise RuntimeError(f"{key}: {rows.shape[0]} recorded rows < {total} tokens of this forward")
            host[self.specs[key].wire_key] = rows[:total].cpu()
        self._rows.clear()
        out, off = [], 0
        for start, n in zip(starts, counts):
            sites = {k: v[off : off + n].numpy().tobytes() for k, v in host.items()}
            out.append({"start": int(start), "n": int(n), "sites": sites})
            off += n
        return out


_CAPTURE: GuidanceCapture | None = None


def active_capture() -> GuidanceCapture | None:
    """The capture of this process (set by the hook factory), or None."""
    return _CAPTURE


def set_capture(capture: GuidanceCapture | None) -> None:
    global _CAPTURE
    _CAPTURE = capture


def request_layout(forward_batch) -> tuple[list[int], list[int]]:
    """(first position, tokens) per request of a ForwardBatch (extend: prefix/extend lens; decode: 1)."""
    mode = forward_batch.forward_mode
    if mode.is_extend():
        starts = list(forward_batch.extend_prefix_lens_cpu)
        counts = list(forward_batch.extend_seq_lens_cpu)
    elif mode.is_decode():
        seq = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens.cpu()
        starts = [int(s) - 1 for s in seq.tolist()]
        counts = [1] * len(starts)
    else:
        raise RuntimeError(f"TRACE guidance capture does not support forward mode {mode}")
    return starts, counts


def make_logits_hook(config: dict):
    """``--forward-hooks`` factory: config ``{"specs": [{"layer", "site", "row_shape", "fmt", "compact"}]}``.

    Creates this process's ``GuidanceCapture`` and returns the forward hook for ``logits_processor``.
    """
    specs = [SiteSpec(int(s["layer"]), s["site"], tuple(s["row_shape"]), s.get("fmt", "nvfp4"),
                      bool(s.get("compact", True))) for s in config.get("specs", [])]
    capture = GuidanceCapture(specs)
    set_capture(capture)
    logger.info("TRACE guidance capture: %d (layer, site) pairs", len(specs))

    def hook(module, args, output):
        forward_batch = args[3] if len(args) > 3 else None
        if forward_batch is None or not hasattr(forward_batch, "forward_mode"):
            raise RuntimeError("TRACE logits hook: expected logits_processor(input_ids, hidden, lm_head, "
                               "forward_batch)")
        starts, counts = request_layout(forward_batch)
        info = dict(output.customized_info or {})
        info[INFO_KEY] = capture.payloads(starts, counts)
        output.customized_info = info
        return output

    return hook
