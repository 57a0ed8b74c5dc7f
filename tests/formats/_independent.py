"""An independent (numpy, brute-force) computation of E2M1/E4M3/NVFP4, to check the reference against.

Different algorithms on purpose: nearest point by exhaustive search with the tie rule
stated directly ("the neighbour with an even mantissa"), e4m3 by enumerating its values.
"""

import numpy as np

GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)


def e2m1_codes(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    a = np.minimum(np.abs(x), 6.0)
    d = np.abs(a[..., None] - GRID)  # [..., 8]
    best = d.min(-1, keepdims=True)
    cand = d == best
    # ties: two candidates; choose the one with even index (mantissa bit 0)
    even = cand & (np.arange(8) % 2 == 0)
    idx = np.where(even.any(-1), even.argmax(-1), cand.argmax(-1))
    return (idx | (np.signbit(x).astype(np.int64) << 3)).astype(np.uint8)


def _e4m3_values() -> np.ndarray:
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            vals.append(v)
    return np.array(sorted(set(vals)), dtype=np.float64)


E4M3 = _e4m3_values()


def e4m3_rn_sat(v: np.ndarray) -> np.ndarray:
    """Round non-negative float32 values to e4m3 (nearest, ties to even mantissa), saturating at 448."""
    v = np.minimum(v.astype(np.float64), 448.0)
    idx = np.searchsorted(E4M3, v)
    idx = np.clip(idx, 1, len(E4M3) - 1)
    lo, hi = E4M3[idx - 1], E4M3[idx]
    pick_hi = (hi - v) < (v - lo)
    tie = (hi - v) == (v - lo)
    # ties to even: the e4m3 code of the value; position in the enumeration parity follows the mantissa LSB
    even_hi = (idx % 2) == 0
    pick_hi = np.where(tie, even_hi, pick_hi)
    out = np.where(pick_hi, hi, lo)
    return np.where(v == 0, 0.0, out).astype(np.float32)


def nvfp4(x: np.ndarray, global_amax: np.ndarray):
    """x float32 [rows, K] (K % 16 == 0); global_amax float32 [rows, 1]
    -> (codes [rows, K], scales f32 [rows, K/16])."""
    x = x.astype(np.float32)
    g = global_amax.astype(np.float32)
    with np.errstate(over="ignore"):  # 2688 / amax overflows for amax < 2688 / FLT_MAX: S_enc saturates
        s_enc = np.float32(2688.0) / np.where(g > 0, g, 1)
    s_enc = np.where(g > 0, np.minimum(s_enc, np.finfo(np.float32).max), np.float32(1.0)).astype(np.float32)
    xb = x.reshape(x.shape[0], -1, 16)
    amax_b = np.abs(xb).max(-1)
    sf = e4m3_rn_sat((s_enc * amax_b / np.float32(6.0)).astype(np.float32))
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(sf[..., None] > 0, (xb * s_enc[..., None]) / sf[..., None], 0).astype(np.float32)
    return e2m1_codes(z).reshape(x.shape), sf
