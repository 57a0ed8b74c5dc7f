"""Decode steps whose inputs all live in fixed device buffers: the step a CUDA-graph decode loop captures.

After a prefill into an ``FP4KVCache(static_rows=C)``, ``StaticDecode`` feeds one token per row through the
backend's model with the tokens, the positions and an attention mask [B, 1, 1, C] held in buffers, and the cache
writing each layer's K/V at a device row (``FP4KVCache.decode_position``). The forward therefore reads no host
value that changes from step to step. ``step`` updates the buffers (tokens, positions + 1, the new row's mask
column, the write row), runs ``forward``, then advances the host bookkeeping (``FP4KVCache.advance``).

``capture()`` (CUDA) records ``forward`` once in a CUDA graph; each ``step`` then updates the buffers and replays
it. Without a capture the steps run eagerly; they give the growing cache's logits within float rounding (the
attention sums over C rows, the rows past the history masked).

Guidance: with ``recorder`` (the one in the backend's ``forward_context`` and the cache), the experts' records and
the routing of each step go into the recorder's static buffers at a device step index
(``GuidanceRecorder.begin_static``), and the K/V sites are read from the cache when the rollout ends, so a replayed
step records too. ``HFRolloutBackend(static_decode="eager" | "graph")`` runs ``generate``'s decode steps here.
"""

from __future__ import annotations

import torch

from .kv_cache import FP4KVCache
from .recorder import GuidanceRecorder


class StaticDecode:
    """Fixed-buffer decode steps of ``backend.model`` over ``cache``.

    cache: an ``FP4KVCache(static_rows=C)`` holding the prefill of the rows (internal left-padded layout).
    attention_mask: bool [B, T0], the prefill's (False: left padding); positions: int64 [B, 1], the prefill's last
        position per row. Run the steps inside ``backend.forward_context(recorder)``.
    recorder: the rollout's ``GuidanceRecorder`` (switched to static steps here; ``step`` ends each step in it).
    """

    def __init__(self, backend, cache: FP4KVCache, attention_mask: torch.Tensor, positions: torch.Tensor,
                 recorder: GuidanceRecorder | None = None):
        if not isinstance(cache, FP4KVCache) or cache.static is None:
            raise ValueError("StaticDecode needs an FP4KVCache(static_rows=...)")
        b, t0 = attention_mask.shape
        if cache.get_seq_length() != t0:
            raise ValueError(f"the cache holds {cache.get_seq_length()} rows but the prefill mask has {t0}")
        if tuple(positions.shape) != (b, 1):
            raise ValueError(f"positions must be [{b}, 1] (each row's last prefill position), got "
                             f"{tuple(positions.shape)}")
        dev = attention_mask.device
        self.backend, self.cache, self.row, self.first = backend, cache, t0, t0
        self.recorder = recorder
        self.step_index = None if recorder is None else recorder.begin_static(cache.static.rows - t0, dev)
        self.tokens = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.positions = positions.to(device=dev, dtype=torch.long).clone()
        self.mask = torch.zeros(b, 1, 1, cache.static.rows, dtype=torch.bool, device=dev)
        self.mask[:, 0, 0, :t0] = attention_mask.bool()
        self.graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None  # the captured forward's output buffer

    def capture(self, warmup: int = 2) -> None:
        """Record ``forward`` in a CUDA graph (after ``warmup`` runs on a side stream: Triton compiles, workspaces;
        0 where a ``step`` ran already, as ``generate`` does); later steps replay it. The warm-up runs write K/V at
        the next row, which its step rewrites; the capture itself runs nothing."""
        if not self.tokens.is_cuda:
            raise ValueError(f"capture needs the backend on CUDA, got {self.tokens.device}")
        self.cache.decode_position().fill_(self.row)
        if self.step_index is not None:
            self.step_index.fill_(self.row - self.first)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._logits = self.forward()

    def forward(self) -> torch.Tensor:
        """One decode step on the buffers as they are: logits [B, V] (the body a CUDA graph would capture)."""
        out = self.backend.model(input_ids=self.tokens, attention_mask=self.mask, position_ids=self.positions,
                                 use_cache=True, logits_to_keep=1, **self.backend.cache_kwargs(self.cache))
        return out.logits[:, -1]

    def step(self, tokens: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` [B, 1] at the next row; ``attend`` bool [B]: which rows' new tokens later steps attend
        (False: a finished row). Returns logits [B, V]."""
        b = self.tokens.shape[0]  # (host shapes only; copy_ broadcast tokens [1, 1] to every row, attend a float)
        if tuple(tokens.shape) != (b, 1) or tokens.is_floating_point() or tuple(attend.shape) != (b,) or \
                attend.dtype != torch.bool:
            raise ValueError(f"step needs tokens int [{b}, 1] and attend bool [{b}], got tokens {tokens.dtype} "
                             f"{tuple(tokens.shape)} and attend {attend.dtype} {tuple(attend.shape)}")
        if self.row >= self.cache.static.rows:
            raise ValueError(f"row {self.row} is past static_rows={self.cache.static.rows}: the cache needs room for "
                             "the prompt plus every new token")
        self.tokens.copy_(tokens)
        self.positions += 1
        self.mask[:, 0, 0, self.row] = attend
        self.cache.decode_position().fill_(self.row)
        if self.step_index is not None:
            self.step_index.fill_(self.row - self.first)
        if self.graph is None:
            logits = self.forward()
        else:
            self.graph.replay()
            logits = self._logits.clone()  # (the next replay overwrites the buffer)
        self.cache.advance(1)
        self.row += 1
        if self.recorder is not None:
            self.recorder.end_step(attend.unsqueeze(1))
        return logits
