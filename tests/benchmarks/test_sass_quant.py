"""The quantize kernels' sm_90 builds (cross-compiled on the CPU by ``benchmarks/sass_quant.py``), chiefly guided
compact + dequant: the trainer's fake-quant forward keeps its block constants in the registers of the thread that
holds the block (no layout exchange through shared memory: session 9's build had 9 barriers), rounds by directed
fp32 additions, and does not spill."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="needs triton (no GPU)")

OP = "guided_compact+dequant"


@pytest.fixture(scope="module")
def build(bench_module):
    sass = bench_module("sass_quant")
    kern, block_m = sass.compile_pair(OP, 2048)
    return sass, kern, block_m * 2048 // (32 * kern.metadata.num_warps)  # elements per thread


def test_guided_tile_has_no_shared_memory_exchange_and_no_spills(build):
    sass, kern, _ = build
    lines = sass.sass(kern.asm["cubin"])
    assert not [ln for ln in lines if "BAR.SYNC" in ln or "STS" in ln or "LDS" in ln]
    assert sass.ptxas_usage(kern.asm["ptx"])[1] == 0


def test_guided_tile_rounds_by_directed_additions(build):
    sass, kern, per_thread = build
    lines = sass.sass(kern.asm["cubin"])
    assert sum(".RM" in ln and "FADD" in ln for ln in lines) >= per_thread  # one per element a thread holds


def test_report_counts_alu_instructions(bench_module):
    sass = bench_module("sass_quant")
    row = sass.report(OP, 2048)
    assert 0 < row["kernel_alu_per_element"] < row["kernel_sass_per_element"]


@pytest.mark.parametrize("op", ["dequantize_nvfp4->bf16", "dequantize_mxfp4->bf16"])
def test_dequantize_builds_use_the_block_table_and_do_not_spill(bench_module, op):
    """NVFP4 and MXFP4 to bf16 on sm_90 build a table per block (one fp32 -> bf16x2 conversion and three bf16x2
    multiplies) instead of converting every output word (the index path: one conversion per word), with the
    exact redo in the same kernel, and without spilling."""
    sass = bench_module("sass_quant")
    kern, block_m = sass.compile_dequant(op, 2048)
    lines = sass.sass(kern.asm["cubin"])
    words_per_thread = block_m * 2048 // 2 // (32 * kern.metadata.num_warps)
    cvt = sum("F2FP.BF16" in ln for ln in lines)
    muls = sum("HMUL2.BF16" in ln or "HFMA2.MMA.BF16" in ln for ln in lines)
    assert 0 < 2 * cvt <= words_per_thread
    assert muls >= 3 * cvt
    assert sass.ptxas_usage(kern.asm["ptx"])[1] == 0


def test_guided_build_prefetches_the_next_row_group(bench_module, monkeypatch):
    """Guided compact + dequant in a prefetching grid (``quant_triton.CONFIG["pair_guided"]["programs_per_sm"]``,
    off by default since session 18): the sm_90 build loads the next row group's x words (two 16-byte loads per
    thread) before it stores the current group's output, and the loop's extra live values fit without spilling."""
    from megatron_trace.kernels import quant_triton

    sass = bench_module("sass_quant")
    cfg = {**quant_triton.CONFIG["pair_guided"], "programs_per_sm": 8}
    monkeypatch.setitem(quant_triton.CONFIG, "pair_guided", cfg)
    kern, _ = sass.compile_pair(OP, 2048)
    lines = sass.sass(kern.asm["cubin"])
    first_store = next(i for i, ln in enumerate(lines) if "STG.E.128" in ln)
    assert sum("LDG.E.128" in ln for ln in lines[:first_store]) >= 4  # this group's and the next group's words
    assert sass.ptxas_usage(kern.asm["ptx"])[1] == 0


def test_record_build_converts_block_scales_in_hardware(bench_module):
    """Quantize + record on sm_90 makes its E4M3 block scale with the GPU's conversion (one per block a thread
    holds), not by bit arithmetic, and divides by 6 without an IEEE division (one FCHK left: S_enc = 2688 / amax,
    per row)."""
    sass = bench_module("sass_quant")
    kern, block_m = sass.compile_pair("quantize_nvfp4_row+record", 2048)
    lines = sass.sass(kern.asm["cubin"])
    blocks_per_thread = block_m * 2048 // 16 // (32 * kern.metadata.num_warps)
    cvt = sum("F2FP.SATFINITE.E4M3" in ln for ln in lines)  # (one converts two blocks' scales)
    assert 2 * cvt >= blocks_per_thread and cvt <= blocks_per_thread
    fast = lines[: next(i for i, ln in enumerate(lines) if "EXIT" in ln)]  # up to the fast path's end
    assert sum("FCHK" in ln for ln in fast) == 1


def test_fast_path_build_drops_the_exact_redo(bench_module):
    """``sass_quant.py --fast-path`` (a process of its own: the kernels' cache keys take the redo check they call
    at their first compile) counts the fast path alone: fewer instructions than the whole kernel, for every op."""
    import json
    import subprocess
    import sys

    sass = bench_module("sass_quant")
    out = subprocess.run([sys.executable, sass.__file__, "--fast-path"], capture_output=True, text=True, check=True)
    rows = {r["op"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert set(rows) == set(sass.OPS) | set(sass.DEQUANT_OPS)
    for op in ("quantize_nvfp4_row+record", "dequantize_nvfp4->bf16"):
        assert rows[op]["fast_path"] and rows[op]["kernel_sass"] < sass.report(op, 2048)["kernel_sass"]


def test_record_build_packs_code_words_with_byte_permutes(bench_module):
    """Quantize + record on sm_90: the block amax by packed bf16 maxima of magnitudes (7 per block of 8 words), the
    codes' signs by 4 byte permutes per code word of 8 codes, the codes stored as 8-byte words and the scales by one
    byte store per block; the only shared-memory traffic is the row amax's reduction (two barriers, none for one
    warp)."""
    sass = bench_module("sass_quant")
    kern, block_m = sass.compile_pair("quantize_nvfp4_row+record", 2048)
    lines = sass.sass(kern.asm["cubin"])
    blocks_per_thread = block_m * 2048 // 16 // (32 * kern.metadata.num_warps)
    fast = lines[: next(i for i, ln in enumerate(lines) if "EXIT" in ln) + 2]  # the fast path (the redo follows)
    assert sum("HMNMX2.BF16" in ln for ln in fast) == 7 * blocks_per_thread
    assert sum("PRMT" in ln for ln in fast) >= 8 * blocks_per_thread  # 2 code words per block
    assert sum("STG.E.64" in ln for ln in fast) == blocks_per_thread
    assert sum("STG.E.U8" in ln for ln in fast) == blocks_per_thread
    assert sum("BAR.SYNC" in ln for ln in fast) == (2 if kern.metadata.num_warps > 1 else 0)  # (a warp: shuffles)
    assert sass.ptxas_usage(kern.asm["ptx"])[1] == 0


def test_guided_build_assembles_bf16_pairs_by_byte_permutes(build):
    """Guided compact + dequant writes each bf16 pair as the high halves of two fp32 bit patterns by one byte
    permute (selector 0x7632), and rounds d1, d3 to bf16 by one conversion per block."""
    sass, kern, per_thread = build
    lines = sass.sass(kern.asm["cubin"])
    assert sum("PRMT" in ln and "0x7632" in ln for ln in lines) >= per_thread // 2
    assert sum("F2FP.BF16" in ln for ln in lines) >= 1


@pytest.mark.parametrize("op", ["quantize_nvfp4_row+record", "guided_compact+dequant", "guided_full+dequant"])
def test_block_reciprocal_has_no_out_of_range_call(bench_module, monkeypatch, op):
    """The block scale's reciprocal (``triton_fp4.recip_rn``) is MUFU.RCP and one Newton step with no call to
    libdevice's out-of-range path: such a call splits the fast path's code, and ptxas then kept all of a thread's
    unpacked elements live across it (quantize + record with 2 warps took 71 registers instead of 40 in session
    18; built here with 2 warps, 32 elements per thread)."""
    from megatron_trace.kernels import quant_triton

    monkeypatch.setitem(quant_triton.CONFIG, "pair", {**quant_triton.CONFIG["pair"], "num_warps": 2})
    sass = bench_module("sass_quant")
    kern, _ = sass.compile_pair(op, 2048)
    lines = sass.sass(kern.asm["cubin"])
    assert not [ln for ln in lines if "CALL" in ln and "rcp" in ln]
    assert any("MUFU.RCP" in ln for ln in lines)
    if op.startswith("quantize"):
        assert sass.ptxas_usage(kern.asm["ptx"])[0] <= 48


def test_guided_full_build_loads_a_code_word_per_block_and_rounds_by_directed_additions(bench_module):
    """Guided full + dequant by magnitudes (``quant_guided_triton.guided_full_tile``): the record's 16 codes of a
    block come in one 8-byte read-only load by the thread that holds the block (no shared-memory exchange), each
    element is rounded by directed fp32 additions, and nothing spills."""
    sass = bench_module("sass_quant")
    kern, block_m = sass.compile_pair("guided_full+dequant", 2048)
    lines = sass.sass(kern.asm["cubin"])
    per_thread = block_m * 2048 // (32 * kern.metadata.num_warps)
    fast = lines[: next(i for i, ln in enumerate(lines) if "EXIT" in ln) + 2]  # the fast path (the redo follows)
    assert sum("LDG.E.64.CONSTANT" in ln for ln in fast) == per_thread // 16
    assert not [ln for ln in fast if "BAR.SYNC" in ln or "STS" in ln or "LDS" in ln]
    assert sum(".RM" in ln and "FADD" in ln for ln in fast) >= per_thread
    assert sass.ptxas_usage(kern.asm["ptx"])[1] == 0


def test_mxfp4_quantize_has_no_redo_and_stores_scale_bytes_in_place(bench_module):
    """Unchecked MXFP4 quantize of bf16 (the pair kernel's tile by packed pairs, ``quant_mx_triton``) has no exact
    redo, so no tile-wide Inf check (a reduction behind two barriers) and no branch: straight-line code that stores
    each block's E8M0 byte by ``st.global.u8`` from the thread that holds the block, without shared memory
    (session 18's build moved the bytes through it; session 19's still reduced the Inf check across the tile), in
    the registers of the fast path alone (session 19: 56 with the redo, 33 without)."""
    sass = bench_module("sass_quant")
    kern, block_m = sass.compile_pair("quantize_mxfp4", 2048)
    lines = sass.sass(kern.asm["cubin"])
    blocks_per_thread = block_m * 2048 // 32 // (32 * kern.metadata.num_warps)
    body = lines[: next(i for i, ln in enumerate(lines) if "EXIT" in ln and "@" not in ln) + 1]
    assert not [ln for ln in lines if "BAR.SYNC" in ln or "STS" in ln or "LDS" in ln]
    assert not [ln for ln in body if "BRA" in ln]
    assert sum("STG.E.U8" in ln for ln in body) == blocks_per_thread
    assert sass.ptxas_usage(kern.asm["ptx"])[0] <= 40
    # bf16 x by packed pairs (quant_mx_triton): one bf16x2 multiply and add per word of two elements
    words = block_m * 2048 // 2 // (32 * kern.metadata.num_warps)
    assert sum("HMUL2.BF16" in ln for ln in body) >= words // 2
    assert sum("VIMNMX.U16x2" in ln for ln in body) >= words


@pytest.mark.parametrize("op", ["guided_compact->codes", "guided_full->codes"])
def test_guided_codes_are_stored_as_code_words(bench_module, op):
    """Guided rounding to codes (bf16 x) stores a block's 16 codes as whole words, one 8-byte store per block,
    signs placed by byte permutes (``triton_fp4.code_words``), instead of a byte store per pair."""
    sass = bench_module("sass_quant")
    kern, block_m = sass.compile_pair(op, 2048)
    lines = sass.sass(kern.asm["cubin"])
    blocks_per_thread = block_m * 2048 // 16 // (32 * kern.metadata.num_warps)
    fast = lines[: next(i for i, ln in enumerate(lines) if "EXIT" in ln) + 2]  # the fast path (the redo follows)
    stores = [ln for ln in fast if "STG" in ln]
    assert len(stores) == blocks_per_thread and all("STG.E.64" in ln for ln in stores)
    assert sum("PRMT" in ln for ln in fast) >= 4 * blocks_per_thread
