"""The per-step study's outcome table and claims, on constructed outcomes (no model)."""

import json

import numpy as np
import pandas as pd
import pytest
from tracesim.analysis.evict_perstep import (
    accuracy_bytes_figure,
    configuration_label,
    outcome_table,
    per_step_claims,
    sign_flip_p,
)


def _rows(config_id, score, design, correct, *, proxy=None, schedule="oneshot", seeds=(0,),
          certified=False, deployable=True, step_bytes=1000.0, cert=np.nan):
    params = json.dumps({"proxy": proxy}) if proxy else "{}"
    out = []
    for s, ok in enumerate(correct):
        for seed in seeds:
            out.append({"config_id": config_id, "score": score, "design": design,
                        "correction": "hajek" if certified else "none",
                        "budget": 0.25 if score != "full" else np.nan, "schedule": schedule,
                        "score_params": params, "certified": certified,
                        "deployable": deployable, "sequence_id": f"s{s}", "seed": seed,
                        "correct": bool(ok), "full_correct": True,
                        "same_tokens_as_full": bool(ok), "step_tokens_fraction": 0.25,
                        "step_bytes": step_bytes, "step_link_bytes": 10.0, "step_us": 5.0,
                        "certificate_mean": cert, "certificate_max": cert,
                        "logprob_mean": -0.1 if ok else -1.0,
                        "failure": "none" if ok else "cache_induced"})
    return out


@pytest.fixture
def outcomes():
    n = 8
    rows = _rows("full", "full", None, [1] * n, step_bytes=4000.0)
    rows += _rows("snap", "snapkv", "topk", [1, 0, 0, 1, 0, 0, 1, 0])
    rows += _rows("ps-q4|step(fresh)", "perstep", "poisson", [1] * 7 + [0], proxy="quant:4",
                  schedule="step", seeds=(0, 1), certified=True, cert=0.1)
    rows += _rows("ps-q4-topk|step(fresh)", "perstep", "topk", [1, 1, 0, 1, 0, 1, 1, 0],
                  proxy="quant:4", schedule="step")
    return pd.DataFrame(rows)


def test_sign_flip_p_is_exact_and_two_sided():
    assert sign_flip_p(np.array([1.0, 1.0, 1.0])) == pytest.approx(2 / 8)
    assert sign_flip_p(np.array([0.0, 0.0])) == 1.0
    assert np.isnan(sign_flip_p(np.array([1.0])))
    big = np.ones(20)
    assert 0 < sign_flip_p(big) < 1e-3


def test_outcome_table_pairs_each_design_with_its_baselines(outcomes):
    table = outcome_table(outcomes).set_index("config_id")
    assert table.loc["full", "accuracy"] == 1 and np.isnan(table.loc["full", "d_full"])
    ps = table.loc["ps-q4|step(fresh)"]
    assert ps["label"] == "perstep[quant:4]/poisson step(fresh)"
    assert ps["d_full"] == pytest.approx(-1 / 8) and ps["n_full"] == 8
    assert ps["d_snapkv"] == pytest.approx(7 / 8 - 3 / 8)
    assert ps["d_topk"] == pytest.approx(7 / 8 - 5 / 8) and ps["runs"] == 16
    assert np.isnan(table.loc["snap", "d_snapkv"]) and np.isnan(table.loc["snap", "d_topk"])
    assert np.isnan(table.loc["ps-q4-topk|step(fresh)", "d_topk"])
    # Holm never lowers a p-value
    for name in ("full", "snapkv", "topk"):
        ok = table[f"p_{name}"].notna()
        assert (table.loc[ok, f"p_{name}_holm"] >= table.loc[ok, f"p_{name}"] - 1e-15).all()
    assert table.loc["full", "step_kib"] == pytest.approx(4000 / 1024)
    assert configuration_label(outcomes.iloc[0]) == "full"
    png, caption = accuracy_bytes_figure(outcome_table(outcomes))
    assert png[:4] == b"\x89PNG" and "bytes" in caption


def test_per_step_claims_use_only_per_step_rows(outcomes):
    from tracesim.analysis.prereg import load_prereg

    claims = per_step_claims(outcomes, load_prereg("data/prereg.yaml"))
    assert claims["C2"]["accuracy_pairs"] == 8
    assert claims["C2"]["accuracy_difference"] == pytest.approx(7 / 8 - 5 / 8)
    assert claims["C3"].estimate == pytest.approx(-1 / 8)
    assert "1 deployable certified per-step" in claims["C3"].detail
    assert claims["C6"].claim == "C6"


def test_the_report_gets_the_per_step_table_claims_and_figure(outcomes):
    from tracesim.analysis.evict_perstep import add_to_report
    from tracesim.analysis.prereg import load_prereg

    class Report:
        tables: dict = {}
        figures: dict = {}

        def add_figure(self, name, made):
            if made is not None:
                self.figures[name] = made

    report = Report()
    prereg = load_prereg("data/prereg.yaml")
    add_to_report(report, outcomes[outcomes["schedule"] == "oneshot"], prereg)
    assert not report.tables and not report.figures  # nothing without per-step outcomes
    add_to_report(report, outcomes, prereg)
    assert "perstep[quant:4]/poisson step(fresh)" in "".join(report.tables.values())
    assert "C3:" in report.tables["per-step designs in the loop: C2, C3, C6"]
    assert "accuracy_vs_bytes" in report.figures


def _write_outcomes(d, frame):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tracesim.integrity import results_record

    d.mkdir()
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), d / "outcomes.parquet")
    rec = results_record(d / "outcomes.parquet", len(frame), frame["config_id"].unique())
    (d / "summary.json").write_text(json.dumps(rec))


def test_several_outcome_directories_join_and_count_shared_rows_once(outcomes, tmp_path, capsys):
    from tracesim.analysis.evict_perstep import load_many, main

    first = outcomes[outcomes.config_id.isin(["full", "snap"])]
    second = outcomes[outcomes.config_id != "snap"]  # the full cache again, plus the per-step
    _write_outcomes(tmp_path / "a", first)
    _write_outcomes(tmp_path / "b", second)
    joined, dropped = load_many([str(tmp_path / "a"), str(tmp_path / "b")])
    assert dropped == 8 and len(joined) == len(outcomes)
    assert sorted(joined.config_id.unique()) == sorted(outcomes.config_id.unique())
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "8 rows already in an earlier directory dropped" in capsys.readouterr().out
    assert main([str(tmp_path / "a"), str(tmp_path / "missing")]) == 2
    assert "no outcomes.parquet" in capsys.readouterr().err
