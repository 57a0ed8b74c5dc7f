"""``bench_quant.py --set``: one ``quant_triton.CONFIG`` value per flag, checked before any GPU work."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="bench_quant imports the Triton kernels")


@pytest.fixture
def config(bench_module, monkeypatch):
    bench = bench_module("bench_quant")
    monkeypatch.setattr(bench.quant_triton, "CONFIG", {k: dict(v) for k, v in bench.quant_triton.CONFIG.items()})
    return bench


def test_set_adds_and_removes_a_key(config):
    config._set_config("pair_guided.programs_per_sm=5")
    assert config.quant_triton.CONFIG["pair_guided"]["programs_per_sm"] == 5
    config._set_config("pair_guided.programs_per_sm=0")
    assert "programs_per_sm" not in config.quant_triton.CONFIG["pair_guided"]
    assert config.quant_triton.CONFIG["pair_guided"]["tile"] == 2048  # the other keys stay


@pytest.mark.parametrize("item, message", [("pair_guided.tile", "ENTRY.KEY=INT"), ("pair.tile=big", "ENTRY.KEY=INT"),
                                           ("paire.tile=1", "expected one of")])
def test_set_rejects_bad_items_naming_what_is_valid(config, item, message):
    with pytest.raises(SystemExit, match=message):
        config._set_config(item)
