"""Where a micro-batch's tokens go in one packed row (THD): ``PackedLayout``.

Trainers that pack a micro-batch's samples into one row (tokens [1, T], Megatron's ``PackedSeqParams(qkv_format=
"thd")``) give the samples' segments as ``cu_seqlens`` (B + 1 ints from 0, non-decreasing). Sample b's tokens (its
``token_mask`` row, in order: left- or right-padded rows alike) go to positions ``cu_seqlens[b], cu_seqlens[b] + 1,
...``; the rest of its segment (a sample padded to a multiple) and positions ``cu_seqlens[-1]`` to ``total`` (the
row's tail padding) hold no token. ``lengths`` (where the row's samples are known apart from their segments: a
``PackedSeqParams`` whose ``cu_seqlens_q`` differs from its ``cu_seqlens_q_padded``) must equal the mask rows'
token counts. ``megatron.packing`` builds one from a ``PackedSeqParams``; the assembly functions
(``records.assemble``, ``packed_assemble.assemble_packed``, the routing twins, ``GuidanceCache.assemble``) take it as
``layout=`` and write the micro-batch's guidance straight into [1, T, ...] (no [B, S, ...] copy first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .site import is_integer


@dataclass(frozen=True)
class PackedLayout:
    """Sample segments ``cu_seqlens`` (B + 1 ints from 0, non-decreasing) of a packed row of ``total`` positions
    (>= ``cu_seqlens[-1]``); ``lengths``: the samples' token counts (B ints >= 0) where known apart from the segments
    (else None). Checked when built (directly or with ``PackedLayout.of``, which also reads a tensor)."""

    cu_seqlens: tuple[int, ...]
    total: int
    lengths: tuple[int, ...] | None = None

    def __post_init__(self):
        cu = _ints(self.cu_seqlens)
        if not cu:
            raise ValueError("cu_seqlens is empty: need B + 1 boundaries from 0")
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {cu[0]} (in {cu})")
        down = [i for i in range(len(cu) - 1) if cu[i + 1] < cu[i]]
        if down:
            i = down[0]
            raise ValueError(f"cu_seqlens must not decrease: cu_seqlens[{i + 1}]={cu[i + 1]} < cu_seqlens[{i}]="
                             f"{cu[i]} (in {cu})")
        if not is_integer(self.total) or int(self.total) < cu[-1]:
            raise ValueError(f"total={self.total!r} must be an int >= cu_seqlens[-1]={cu[-1]} (the packed row's "
                             "length)")
        lengths = self.lengths
        if lengths is not None:
            lengths = lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths
            if not isinstance(lengths, (list, tuple)):
                raise ValueError(f"lengths must be B ints (the samples' token counts), got {lengths!r}")
            bad = [n for n in lengths if not is_integer(n) or int(n) < 0]
            if bad:  # (1.5 was truncated to 1 token)
                raise ValueError(f"lengths must be ints >= 0 (the samples' token counts), got {bad[0]!r} in "
                                 f"{lengths}")
            if len(lengths) != len(cu) - 1:
                raise ValueError(f"{len(lengths)} sample lengths for {len(cu) - 1} segments (cu_seqlens={cu})")
            lengths = tuple(int(n) for n in lengths)
        object.__setattr__(self, "cu_seqlens", tuple(cu))  # (frozen: the checked, normalized values)
        object.__setattr__(self, "total", int(self.total))
        object.__setattr__(self, "lengths", lengths)

    @classmethod
    def of(cls, cu_seqlens, *, total: int | None = None, lengths: Sequence[int] | None = None) -> PackedLayout:
        """A checked layout from ``cu_seqlens`` (an int tensor or a list of ints [B + 1]); ``total`` default
        ``cu_seqlens[-1]``."""
        cu = _ints(cu_seqlens)
        return cls(tuple(cu), cu[-1] if total is None and cu else total, lengths)

    @property
    def batch(self) -> int:
        return len(self.cu_seqlens) - 1

    def positions(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 (src, dst) on ``mask``'s device: each token of ``mask`` ([B, S], see ``check``; row-major order) as
        its batch-major position ``b * S + s`` and its packed position. Refuses a mask that does not fit."""
        mask = self._checked(mask)
        b, s = mask.nonzero().unbind(1)  # row-major: sample by sample, positions in order
        rank = (mask.long().cumsum(1) - 1)[b, s]  # the token's index among its sample's tokens
        start = torch.tensor(self.cu_seqlens[:-1], dtype=torch.int64, device=mask.device)
        return b * mask.shape[1] + s, start[b] + rank

    def check(self, mask: torch.Tensor) -> None:
        """``mask`` ([B, S]: bool, or an attention mask whose nonzero entries are tokens, as ``records.token_mask``
        reads it) has this layout's B rows, each no longer than its segment (and as long as its sample where
        ``lengths`` are known)."""
        self._checked(mask)

    def _checked(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` as bool [B, S] (``check``'s rule), or ValueError."""
        cu = list(self.cu_seqlens)
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"token mask has shape {shape}: a packed layout needs bool [B, S]")
        mask = mask.bool()  # (an int mask holding 2, or a float one holding 0.5, marks a token there)
        B = mask.shape[0]
        if B != self.batch:
            raise ValueError(f"cu_seqlens has {len(cu)} entries, the micro-batch has B={B} samples: need B + 1 = "
                             f"{B + 1} (a trailing padding segment is given as total=, not as a sample)")
        counts = mask.sum(1).tolist()  # (one host read)
        if self.lengths is not None and tuple(counts) != self.lengths:
            b = next(i for i, (n, a) in enumerate(zip(counts, self.lengths)) if n != a)
            raise ValueError(f"sample {b} has {counts[b]} tokens in its token_mask row, but the PackedSeqParams holds "
                             f"{self.lengths[b]} (cu_seqlens_q, the samples' lengths: {list(self.lengths)}); the "
                             "token_mask must mark exactly the tokens the packed row holds (the rest would be "
                             "unguided and not counted)")
        for b, n in enumerate(counts):
            if n > cu[b + 1] - cu[b]:
                raise ValueError(f"sample {b} has {n} tokens, longer than its segment cu_seqlens[{b}:{b + 2}]="
                                 f"{cu[b:b + 2]} ({cu[b + 1] - cu[b]} positions); cu_seqlens must give each sample "
                                 "at least its token_mask row's tokens")
        return mask

    def token_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """bool [1, total]: the packed positions that hold one of ``mask``'s tokens."""
        out = torch.zeros(1, self.total, dtype=torch.bool, device=mask.device)
        out[0, self.positions(mask)[1]] = True
        return out


def as_layout(layout) -> PackedLayout:
    """``layout`` (an assembly's ``layout=``) if it is a ``PackedLayout``, else TypeError naming what to give."""
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"layout= takes a guidance.layout.PackedLayout (megatron.packed_layout(packed_seq_params, "
                        f"total=T), or PackedLayout.of(cu_seqlens, total=T)), got {type(layout).__name__}")
    return layout


def _ints(cu_seqlens) -> list[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must be integer (int32 as PackedSeqParams holds it), got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D [B + 1], got shape {tuple(cu_seqlens.shape)}")
        return cu_seqlens.tolist()
    if isinstance(cu_seqlens, (list, tuple)):
        bad = [v for v in cu_seqlens if not is_integer(v)]
        if bad:  # (1.5 would place a sample between positions; [[0, 3]] is no 1-D list)
            raise ValueError(f"cu_seqlens must be 1-D integers, got {bad[0]!r} in {list(cu_seqlens)}")
        return [int(v) for v in cu_seqlens]
    if hasattr(cu_seqlens, "cu_seqlens_q"):  # (guidance does not import Megatron: PackedSeqParams by its fields)
        raise ValueError("a PackedSeqParams gives its layout through megatron.packed_layout(packed_seq_params, "
                         "total=T), not PackedLayout.of")
    raise ValueError(f"cu_seqlens must be an integer tensor or a list of ints [B + 1] (or a PackedSeqParams), "
                     f"got {type(cu_seqlens).__name__}")
