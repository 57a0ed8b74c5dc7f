"""Numeric constants of the FP4 formats: the one place they live (DESIGN.md §3)."""

E2M1_MAX = 6.0
"""Largest E2M1 magnitude."""

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 magnitudes indexed by the 3-bit code (sign bit excluded)."""

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value (NVFP4 block scales saturate here)."""

NVFP4_BLOCK = 16
"""NVFP4 block length along the last (K) dimension."""

MXFP4_BLOCK = 32
"""MXFP4 block length along the last (K) dimension (OCP MX v1.0)."""

E8M0_BIAS = 127
"""Exponent bias of the E8M0 (float8_e8m0fnu) MX scale; 255 encodes NaN."""

E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127

E2M1_EMAX = 2
"""floor(log2(E2M1_MAX)): the OCP MX spec subtracts it from floor(log2(amax))."""
