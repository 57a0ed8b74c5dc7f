"""Launch planning of the fast FP4-KV decode attention (``kv_attention_triton``): default launch configs per
head_dim, the programs each config keeps resident per multiprocessor, the split count along T, and how the block
scales and the kv_mask can be loaded. Host code only."""

from __future__ import annotations

import functools

import torch

from .dispatch import cdiv, sm_count

MASK_AS_WORDS = True
"""``kv_mask`` is read as int32 words of 4 tokens: a 4-byte load that cp.async copies ahead of the tile loop (a
byte per token could not be; the rollout's decode passes the mask on every call). False: bytes (for A/B)."""
SPLIT_WAVES = 4
"""Exact path: splits along T are chosen so that about this many programs per multiprocessor run."""
FAST_CONFIGS = {32: (64, 1, 2, None), 64: (32, 1, 2, None), 128: (32, 1, 3, None), 256: (64, 4, 2, None)}
"""Fast path (BT, num_warps, num_stages, max_registers) per head_dim (smaller head dims take the first row), from
the sm_90 cross-compile (``benchmarks/sass_kv_attention.py``: registers, spills, shared memory, SASS per K/V
element) and the H200 (``bench_decode_attn.py``, 16 query / 4 KV heads). Session 9: one warp per program (no
cross-warp softmax reductions, so no barriers in the tile loop). head_dim 128 (32, 1, 3): 255 registers, 8
programs per multiprocessor, 4.4 SASS per element; 24.1 / 125.4 / 66.5 / 453.2 us at batch 8 / 64 and 8K / 32K,
where session 8's (128, 4, 3, cap 128) took 25.9 / 136.9 / 73.6 / 505.4. head_dim 64 (32, 1, 2): 17.6 / 76.6 us
at batch 8 / 64 and 8K (was (64, 2, 2): 24.2 / 145.9; more warps split the V MMA's N = D/4 = 16 columns,
replicating the dequantization). head_dim 32 (64, 1, 2): 29.2 / 168.0 (was 47.5 / 306.3; still slower than bf16
SDPA there). head_dim 256: not swept."""
FAST_RESIDENT = {(32, 64, 2, 2, None): 6, (32, 32, 1, 2, None): 14, (32, 64, 1, 2, None): 12, (32, 32, 1, 3, None): 16,
                 (64, 64, 2, 2, None): 4, (64, 64, 1, 2, None): 8, (64, 64, 1, 3, None): 12,
                 (64, 32, 1, 2, None): 16, (64, 32, 1, 3, None): 15, (256, 64, 4, 2, None): 2,
                 **{(128, bt, nw, ns, mr): r for bt, nw, ns, mr, r in (
                     (128, 4, 2, None, 3), (128, 4, 3, None, 3), (128, 4, 4, None, 3), (128, 4, 2, 128, 4),
                     (128, 4, 3, 128, 4), (64, 4, 2, None, 4), (64, 4, 3, None, 4), (64, 2, 3, None, 4),
                     (32, 1, 2, None, 8), (32, 1, 3, None, 8), (64, 1, 2, None, 8), (16, 1, 3, None, 11),
                     (32, 1, 4, None, 8), (64, 1, 3, None, 8))}}
"""Programs of the fast kernel resident per multiprocessor on sm_90, keyed (head_dim row of ``FAST_CONFIGS``, BT,
num_warps, num_stages, max_registers), from registers and shared memory (``sass_kv_attention.py``'s
``resident``), for ``fast_splits``; other configs count 2."""


def config_key(d: int) -> int:
    return min((k for k in FAST_CONFIGS if k >= d), default=max(FAST_CONFIGS))


def fast_config(d: int) -> tuple[int, int, int, int | None]:
    """The fast path's default (BT, num_warps, num_stages, max_registers) for head_dim ``d`` (``FAST_CONFIGS``)."""
    return FAST_CONFIGS[config_key(d)]


def scale_word(asm: bool, fmt: str, d: int, block: int, *scales: torch.Tensor) -> int:
    """Bytes per load of the fast path's block scales (``SW``): 4 or 2 (NVFP4 on the GPU, inline PTX, or MXFP4)
    when the blocks per row and the tensors' byte strides and bases divide by it, else 1 (byte loads)."""
    if not (asm or fmt == "mxfp4"):
        return 1
    for w in (4, 2):
        if (d // block) % w == 0 and all(x.data_ptr() % w == 0 and all(st % w == 0 for st in x.stride()[:-1])
                                         for x in scales):
            return w
    return 1


def sm_count_of(q: torch.Tensor) -> int:
    return sm_count(q.device) if q.is_cuda else 4


def exact_splits(q: torch.Tensor, bsz: int, hkv: int, t_len: int, block_t: int) -> int:
    """Exact path: about ``SPLIT_WAVES`` programs per multiprocessor."""
    return max(1, min(cdiv(SPLIT_WAVES * sm_count_of(q), bsz * hkv), cdiv(t_len, block_t)))


MAX_FAST_SPLITS = 128
"""At most this many splits along T (the partials ``combine`` reads grow with them: batch 1 at 8K took 1024 splits
of one tile, whose combine took 4x the attention kernel's time on the H200, session 14)."""


@functools.lru_cache(maxsize=4096)
def fast_splits(pairs: int, n_tiles: int, slots: int, max_splits: int = MAX_FAST_SPLITS) -> int:
    """Fast path: splits along T of ``n_tiles`` tiles for ``pairs`` (batch, KV head) programs on ``slots`` resident
    program slots (multiprocessors x programs each). Each split takes ceil(n_tiles / s) tiles and every split is
    a program (no empty ones); slots run their programs one after another, so the launch takes about
    waves x (tiles per split + 1) tile times (the 1: a program's prologue and its partial's store). The cheapest
    count up to ``max_splits`` wins (ties: fewer splits). E.g. batch 8, 4 KV heads, 8K context at 128 tokens on
    132 x 3 slots: 11 splits of 6 tiles in one wave (about 4 / SPLIT_WAVES per multiprocessor gave 16 of 4 in 1.4
    waves)."""
    best = (float("inf"), 1)
    for s in range(1, min(n_tiles, max_splits) + 1):
        per = cdiv(n_tiles, s)
        real = cdiv(n_tiles, per)
        if real != s:  # the same split as a smaller s
            continue
        cost = cdiv(pairs * real, slots) * (per + 1)
        if cost < best[0]:
            best = (cost, real)
    return best[1]


def mask_arg(kv_mask: torch.Tensor, t_len: int, device) -> tuple[torch.Tensor, bool]:
    """kv_mask [B, >= T] -> (int32 words [B, T4 / 4] of 4 token bytes (T4 = T rounded up to 4), True) with
    ``MASK_AS_WORDS``, else (uint8 [B, T], False). A bool/uint8 mask already laid out as words (a row of >= T4
    contiguous bytes, row stride and offset divisible by 4: e.g. transformers' SDPA mask at a context divisible by 4)
    is viewed, not copied, else copied into words; the bytes past T are read and ignored (the kernel attends only
    rows before T)."""
    if not MASK_AS_WORDS:
        return kv_mask[:, :t_len].to(device=device, dtype=torch.uint8), False
    t4 = cdiv(t_len, 4) * 4
    m = kv_mask
    if (m.dtype in (torch.bool, torch.uint8) and m.device == torch.device(device) and m.shape[1] >= t4
            and m.stride(1) == 1 and m.stride(0) % 4 == 0 and m.storage_offset() % 4 == 0):
        return m[:, :t4].view(torch.uint8).view(torch.int32), True
    w = torch.empty(m.shape[0], t4, dtype=torch.uint8, device=device)  # (bytes past T: never attended, see above)
    w[:, :t_len] = m[:, :t_len]
    return w.view(torch.int32), True
