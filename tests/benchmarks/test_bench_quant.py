"""``bench_quant.py --set``: one ``quant_triton.CONFIG`` value per flag, checked before any GPU work; ``--ops`` (and
``sass_quant.py --ops``): a substring in no op name refused."""

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


def test_ops_substring_matching_no_op_is_refused(config):
    """``--ops``: a substring in no op name was dropped without a word (``guidde`` timed nothing, exit 0)."""
    names = ["quantize_nvfp4_row+record", "guided_compact+dequant", "dequantize_nvfp4->bf16"]
    config.check_ops(("guided", "dequant"), names)  # each matches
    config.check_ops((), names)  # no filter: every op
    with pytest.raises(SystemExit, match=r"\['guidde'\] in no op name; the ops: quantize_nvfp4_row\+record"):
        config.check_ops(("quantize", "guidde"), names)


def test_sass_quant_refuses_an_ops_substring_in_no_op_name(bench_module, capsys):
    sass = bench_module("sass_quant")
    with pytest.raises(SystemExit) as exc:  # before: nothing reported, exit 0 (refused before any compile now)
        sass.main(["--ops", "guided_compact,guidde"])
    assert exc.value.code == 2 and "['guidde'] in no op name" in capsys.readouterr().err
