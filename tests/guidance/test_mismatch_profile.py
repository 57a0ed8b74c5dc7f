"""``mismatch_profile.profile_from_metrics`` and ``plan --mismatch-profile metrics.jsonl``: per-layer code-mismatch
rates read from rows the demo's own writer (``metrics.quant_metrics`` -> ``rl.report.MetricsWriter``) wrote."""

import json
import math
import re

import pytest

from megatron_trace.cli import plan
from megatron_trace.config import ACTIVATION_SITES
from megatron_trace.guidance.accounting import bytes_per_layer
from megatron_trace.guidance.mismatch_profile import profile_from_metrics
from megatron_trace.guidance.model_dims import ModelDims
from megatron_trace.metrics import QuantCounts, quant_metrics
from megatron_trace.rl.report import MetricsWriter

from ..rollout._tiny import tiny_config

HF = tiny_config().to_dict()  # 3 MoE layers; per token: FC1 64, FC2 2 x 32, K and V 2 x 16 elements each
DIMS = ModelDims.from_hf_config(HF)
ELEMS = {"expert_fc1_in": 64, "expert_fc2_in": 64, "kv_k": 32, "kv_v": 32}


def _counts(rates: dict) -> dict:
    """QuantCounts of 1000 rows per (layer, site) whose code-mismatch rate is ``rates[(layer, site)]``."""
    n = {k: 1000 * ELEMS[k[1]] for k in rates}
    return {k: QuantCounts(elements=n[k], mismatched=round(r * n[k]), blocks=1) for k, r in rates.items()}


def _write(out_dir, arm: str, per_step: list[dict]) -> None:
    w = MetricsWriter(out_dir)
    for step, rates in enumerate(per_step):
        w.write(arm, step, {"reward": 0.5, **(quant_metrics(_counts(rates)) if rates else {})})
    w.close()


def _uniform(layer_rates, kv=None) -> dict:
    """The same rate at every expert site of a layer; ``kv`` (default: the same) at its K and V."""
    out = {}
    for layer, r in enumerate(layer_rates):
        for site in ACTIVATION_SITES:
            out[(layer, site)] = r if kv is None or not site.startswith("kv") else kv[layer]
    return out


def test_rates_are_averaged_over_the_last_steps_and_weighted_by_elements(tmp_path):
    steps = [_uniform([0.5, 0.5, 0.5]), {}, _uniform([0.01, 0.04, 0.02], kv=[0.0, 0.01, 0.08]),
             _uniform([0.03, 0.06, 0.02], kv=[0.0, 0.03, 0.08])]  # step 1: quant metrics not measured
    _write(tmp_path, "fp4_qat", steps)
    _write(tmp_path, "trace", [_uniform([0.0, 0.0, 0.0])] * 4)  # guided: ~0, must not be read
    path = tmp_path / "metrics.jsonl"
    prof = profile_from_metrics(path, DIMS, ACTIVATION_SITES, arm="fp4_qat", last=2)
    # layer 1: experts (0.04 + 0.06) / 2 = 0.05 over 128 elements, K/V (0.01 + 0.03) / 2 = 0.02 over 64
    assert prof == pytest.approx([(0.02 * 128 + 0.0 * 64) / 192, (0.05 * 128 + 0.02 * 64) / 192,
                                  (0.02 * 128 + 0.08 * 64) / 192])
    # last=3: step 0's 0.5 comes in (step 1 has no value: the last 3 measured steps are 0, 2, 3)
    assert profile_from_metrics(path, DIMS, ACTIVATION_SITES, arm="fp4_qat", last=3)[0] == pytest.approx(
        ((0.5 + 0.01 + 0.03) / 3 * 128 + 0.5 / 3 * 64) / 192)
    # one site: its own rate
    assert profile_from_metrics(path, DIMS, ["kv_k"], arm="fp4_qat", last=2) == pytest.approx([0.0, 0.02, 0.08])


def test_profile_errors_name_the_arm_layers_and_sites(tmp_path):
    _write(tmp_path, "fp4_qat", [_uniform([0.01, 0.02, 0.03])])
    _write(tmp_path, "trace", [_uniform([0.0, 0.0, 0.0])])
    _write(tmp_path, "bf16", [{}])
    path = tmp_path / "metrics.jsonl"
    with pytest.raises(ValueError, match=r"for arms \['fp4_qat', 'trace'\]: name one .*fp4_qat"):
        profile_from_metrics(path, DIMS, ACTIVATION_SITES)
    with pytest.raises(ValueError, match=r"arm='bf16' has no per-layer .* arms that have them: \['fp4_qat', 'trace'\]"):
        profile_from_metrics(path, DIMS, ACTIVATION_SITES, arm="bf16")
    with pytest.raises(ValueError, match="last=0 must be an int >= 1"):
        profile_from_metrics(path, DIMS, ACTIVATION_SITES, arm="fp4_qat", last=0)
    deeper = ModelDims.from_hf_config({**HF, "num_hidden_layers": 4})
    with pytest.raises(ValueError, match=r"4 guided \(layer, site\) pair\(s\), e.g. \[\(3, 'expert_fc1_in'\)"):
        profile_from_metrics(path, deeper, ACTIVATION_SITES, arm="fp4_qat")
    shallower = ModelDims.from_hf_config({**HF, "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="layer.s. up to 2, the model has 2 layers .* another model"):
        profile_from_metrics(path, shallower, ACTIVATION_SITES, arm="fp4_qat")
    nan = tmp_path / "nan"
    _write(nan, "fp4_qat", [{(0, "kv_k"): 0.1, (1, "kv_k"): 0.1, (2, "kv_k"): 0.1}])
    rows = [json.loads(line) for line in (nan / "metrics.jsonl").read_text().splitlines()]
    rows[0]["quant/kv_k/layer_1/code_mismatch_rate"] = math.nan  # a layer without valid rows reads NaN
    with pytest.raises(ValueError, match=r"1 guided \(layer, site\) pair\(s\), e.g. \[\(1, 'kv_k'\)\]"):
        profile_from_metrics(rows, DIMS, ["kv_k"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arm": "fp4_qat"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is a JSON list, not an object"):
        profile_from_metrics(bad, DIMS, ACTIVATION_SITES)


def test_cli_budget_from_a_metrics_jsonl_picks_the_layers_with_the_highest_rates(tmp_path, capsys):
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(HF))
    _write(tmp_path, "fp4_qat", [_uniform([0.01, 0.05, 0.03]), _uniform([0.03, 0.07, 0.01])])
    _write(tmp_path, "trace", [_uniform([0.0, 0.0, 0.0])] * 2)
    metrics = tmp_path / "metrics.jsonl"
    one = bytes_per_layer(DIMS, ACTIVATION_SITES, compact=True)[0]  # all 3 layers cost the same
    argv = ["--hf-config", str(cfg_path), "--layer-policy", f"budget={2 * one}", "--modes", "compact",
            "--mismatch-profile", str(metrics), "--mismatch-arm", "fp4_qat", "--json"]
    assert plan.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["mismatch_profile"]["unit"] == "rate"
    assert res["mismatch_profile"]["values"] == pytest.approx([0.02, 0.06, 0.02])  # the last 3 (here: 2) steps
    assert res["rows"][0]["layers"] == [1, 2]  # 1 first; 0 and 2 tie at 0.02: the deeper one
    assert plan.main([*argv, "--mismatch-last", "1"]) == 0  # the last step alone: 0.03, 0.07, 0.01
    assert json.loads(capsys.readouterr().out)["rows"][0]["layers"] == [0, 1]
    # the guided arm's ~0 rates guide nothing; with two arms the arm must be named; a mass unit is refused
    assert plan.main([*argv[:-3], "--mismatch-arm", "trace", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["layers"] == []
    assert plan.main([a for a in argv if a not in ("--mismatch-arm", "fp4_qat")]) == 2
    assert "for arms ['fp4_qat', 'trace']: name one" in capsys.readouterr().err
    assert plan.main([*argv, "--mismatch-unit", "mass"]) == 2
    assert "--mismatch-unit mass applies to a JSON profile only" in capsys.readouterr().err


def test_cli_json_profiles_take_rates_or_masses(tmp_path, capsys):
    """A JSON profile is read in ``--mismatch-unit`` (rate by default); a rate above 1 is refused by name."""
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(HF))
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"0": 2.0, "1": 0.5, "2": 1.0}))
    one = bytes_per_layer(DIMS, ACTIVATION_SITES, compact=True)[0]
    argv = ["--hf-config", str(cfg_path), "--layer-policy", f"budget={one}", "--modes", "compact",
            "--mismatch-profile", str(prof), "--json"]
    assert plan.main(argv) == 2
    assert "rates must be fractions in [0, 1]" in capsys.readouterr().err
    assert plan.main([*argv, "--mismatch-unit", "mass"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["layers"] == [0]
    prof.write_text("0.1, 0.2")
    assert plan.main(argv) == 2
    assert "is not JSON" in capsys.readouterr().err


def test_rows_without_an_arm_are_one_run():
    """Rows without an ``arm`` (one run's own log, passed as rows) are that run's: the arm picker called them arm
    'None' and then kept no row, so the read failed with a bare "max() arg is an empty sequence"."""
    per_step = [[0.1, 0.2, 0.3], [0.3, 0.2, 0.1]]
    rows = [{"step": s, **quant_metrics(_counts(_uniform(r)))} for s, r in enumerate(per_step)]
    assert profile_from_metrics(rows, DIMS, ACTIVATION_SITES, last=2) == pytest.approx([0.2, 0.2, 0.2])


def test_last_means_the_latest_steps_whatever_the_row_order():
    """Rows passed in another order (merged logs, newest first) still average the latest ``last`` steps."""
    per_step = [[0.1, 0.2, 0.3], [0.3, 0.2, 0.1], [0.5, 0.4, 0.0]]
    rows = [{"arm": "fp4_qat", "step": s, **quant_metrics(_counts(_uniform(r)))} for s, r in enumerate(per_step)]
    assert profile_from_metrics(rows[::-1], DIMS, ACTIVATION_SITES, last=1) == pytest.approx([0.5, 0.4, 0.0])
    assert profile_from_metrics(rows[::-1], DIMS, ACTIVATION_SITES, last=2) == pytest.approx([0.4, 0.3, 0.05])


# ---- audit (session 56): reading rules a mutation run found untested ---------------------------------------
def _rows(per_step, arm="fp4_qat", drop=()):
    """Rows of ``arm`` with uniform per-layer rates, the (layer, site) pairs in ``drop`` not measured."""
    return [{"arm": arm, "step": s, **quant_metrics(_counts({k: v for k, v in _uniform(r).items() if k not in drop}))}
            for s, r in enumerate(per_step)]


def test_a_layer_without_a_site_is_weighted_without_it_and_reads_0_without_any():
    """A dense layer (no experts) has no expert rates: its rate is its K/V sites' alone, and 0 when none of the
    planned sites is there (guiding it guides nothing), not an error for the expert sites it lacks."""
    dims = ModelDims.from_hf_config({**HF, "mlp_only_layers": [0]})
    assert not dims.has_site(0, "expert_fc1_in") and dims.has_site(0, "kv_k") and dims.has_site(1, "expert_fc2_in")
    rows = _rows([[0.3, 0.2, 0.1]], drop={(0, "expert_fc1_in"), (0, "expert_fc2_in")})
    for r in rows:
        r["quant/kv_v/layer_0/code_mismatch_rate"] = 0.5  # layer 0: K 0.3, V 0.5 (32 elements each) -> 0.4
    assert profile_from_metrics(rows, dims, ACTIVATION_SITES) == pytest.approx([0.4, 0.2, 0.1])
    assert profile_from_metrics(rows, dims, ["expert_fc1_in", "expert_fc2_in"]) == pytest.approx([0.0, 0.2, 0.1])


def test_only_finite_numbers_are_rates():
    """A step whose value is Inf, a bool or a string (a damaged or foreign row) is skipped like a NaN one: the
    latest finite values are averaged."""
    for bad in (math.inf, -math.inf, True, "0.9"):
        rows = _rows([[0.1, 0.1, 0.1], [0.3, 0.3, 0.3]])
        rows.append({**rows[-1], "step": 2, "quant/kv_k/layer_2/code_mismatch_rate": bad})
        # layers 0 and 1: steps 1 and 2 (0.3 each); layer 2: its finite steps 0 and 1
        assert profile_from_metrics(rows, DIMS, ["kv_k"], last=2) == pytest.approx([0.3, 0.3, 0.2]), bad


def test_only_per_layer_rate_keys_of_the_prefix_count():
    """A key of another prefix, a per-layer key with a suffix, or a 'sublayer_' key is no per-layer rate: it names
    no arm, adds no layer (here: past the model's 3) and is not averaged."""
    rows = _rows([[0.1, 0.2, 0.3]])
    rows.append({"arm": "other", "step": 0, "guidance/kv_k/layer_0/code_mismatch_rate": 0.5,
                 "quant/kv_k/layer_0/code_mismatch_rate_std": 0.5})
    rows[0].update({"quant/kv_k/layer_7/code_mismatch_rate_std": 0.5, "quant/kv_k/sublayer_9/code_mismatch_rate": 0.5})
    assert profile_from_metrics(rows, DIMS, ACTIVATION_SITES) == pytest.approx([0.1, 0.2, 0.3])  # 'other' has none


def test_read_errors_are_named():
    """No arm with rates; ``last`` a bool; a line that is not JSON (blank lines are skipped); every missing pair
    listed (up to six)."""
    with pytest.raises(ValueError, match=r"for arms \[\]: name one"):
        profile_from_metrics([{"arm": "bf16", "step": 0, "reward": 1.0}], DIMS, ACTIVATION_SITES)
    with pytest.raises(ValueError, match="last=True must be an int >= 1"):
        profile_from_metrics(_rows([[0.1] * 3]), DIMS, ACTIVATION_SITES, last=True)
    deeper = ModelDims.from_hf_config({**HF, "num_hidden_layers": 4})
    with pytest.raises(ValueError, match=re.escape("4 guided (layer, site) pair(s), e.g. [(3, 'expert_fc1_in'), "
                                                   "(3, 'expert_fc2_in'), (3, 'kv_k'), (3, 'kv_v')]")):
        profile_from_metrics(_rows([[0.1] * 3]), deeper, ACTIVATION_SITES)


def test_a_metrics_file_with_blank_lines_reads_and_a_non_json_line_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _rows([[0.1, 0.2, 0.3]])) + "\n\n  \n")
    assert profile_from_metrics(path, DIMS, ACTIVATION_SITES) == pytest.approx([0.1, 0.2, 0.3])
    path.write_text(path.read_text() + "{nope\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:4 is not a JSON line \(.*\); a metrics.jsonl has one object"):
        profile_from_metrics(path, DIMS, ACTIVATION_SITES)


@pytest.mark.parametrize("sites", [(), [], "kv_k", ["kv_k", "fc1"], None])
def test_profile_sites_that_are_no_list_of_activation_sites_are_named(tmp_path, sites):
    """No site read every layer as 0 (a flat profile, silently); a str was iterated as its characters ('k')."""
    _write(tmp_path, "fp4_qat", [_uniform([0.01, 0.02, 0.03])])
    with pytest.raises(ValueError, match=r"sites=.* must be a non-empty list of sites from \('expert_fc1_in'"):
        profile_from_metrics(tmp_path / "metrics.jsonl", DIMS, sites, arm="fp4_qat")
