"""The ModelOpt export streams: its peak host memory is about one shard, not the checkpoint.

Measured as tests/bridge/test_load_memory.py measures the load: a spawned process resets its peak-RSS mark
(``echo 5 > /proc/self/clear_refs``, Linux), records VmRSS, runs ``save_modelopt_checkpoint`` over a stream (the
weights made one at a time and quantized by ``fp4_stream`` in small batches, as from the bridge's export) and reads
VmHWM; the growth is VmHWM - VmRSS, after a tiny export made the lazy imports. glibc's malloc serves allocations
of 128 KiB and more by mmap (``MALLOC_MMAP_THRESHOLD_``; its default threshold grows to 32 MiB and freed heap
memory stays resident), so the peak follows the bytes alive. The checkpoint (~58 MiB) is dominated by the FP4
experts; an export that held its state in memory grows by at least that (69 MiB measured), a streaming one by a
shard (4 MiB) plus the quantizer's working set (16 MiB measured).
"""

import multiprocessing as mp
import os

import pytest
import torch

from .._rss import peak_growth
from ._tiny import named_weights, tiny_hf_config

SHARD = 4 << 20
SLACK = 20 << 20  # the shard's serialisation, one quantizer batch and its fp32 intermediates, allocator rounding
BIG = dict(layers=2, experts=64, hidden=512, ffn=512, vocab=1024)  # 100M expert elements: 57 MB of FP4


def _worker(out: str) -> None:
    from megatron_trace.bridge.sync import fp4_stream
    from megatron_trace.config import TraceConfig
    from megatron_trace.export import save_modelopt_checkpoint

    torch.set_num_threads(1)
    quant = TraceConfig().weight_quantizer()
    save_modelopt_checkpoint(os.path.join(out, "warm-up"), fp4_stream(named_weights(), quant), tiny_hf_config(), 2.0)
    named = fp4_stream(named_weights(**BIG), quant, batch_bytes=1 << 20)
    config = {**tiny_hf_config(), "hidden_size": BIG["hidden"], "moe_intermediate_size": BIG["ffn"],
              "num_experts": BIG["experts"], "num_hidden_layers": BIG["layers"], "vocab_size": BIG["vocab"]}
    growth = peak_growth(lambda: save_modelopt_checkpoint(os.path.join(out, "ckpt"), named, config, input_amax=2.0,
                                                          max_shard_bytes=SHARD))
    torch.save({"growth": growth}, os.path.join(out, "result.pt"))


def test_peak_export_memory_is_about_one_shard(tmp_path, monkeypatch):
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        pytest.skip(f"peak-RSS reset (/proc/self/clear_refs) unavailable: {e}")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 << 10))  # (the spawned worker's malloc)
    p = mp.get_context("spawn").Process(target=_worker, args=(str(tmp_path),))
    p.start()
    p.join(timeout=240)
    assert p.exitcode == 0, "the export worker failed (see its stderr above)"
    growth = torch.load(tmp_path / "result.pt")["growth"]
    ckpt = sum(os.path.getsize(tmp_path / "ckpt" / f) for f in os.listdir(tmp_path / "ckpt"))
    shards = [f for f in os.listdir(tmp_path / "ckpt") if f.endswith(".safetensors")]
    assert ckpt > 50 << 20 and len(shards) > 10  # the bound below discriminates: a held state could not pass
    assert growth <= SHARD + SLACK, f"peak growth {growth / 2**20:.1f} MiB for a {ckpt / 2**20:.1f} MiB checkpoint"
