"""The per-step claims in the report: C10 from ``tracesim peers`` output when it is given (and
why not when it is not), and C1/C2 leaving the per-step rows to C9."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tracesim.analysis.claims import INPUT_MISSING, NOT_EVALUATED, NOT_SUPPORTED, SUPPORTED
from tracesim.analysis.claims_replay import evaluate_c1, evaluate_c2_attention
from tracesim.analysis.perstep import evaluate_c10
from tracesim.analysis.prereg import load_prereg, prereg_hash
from tracesim.analysis.report import build_report, write_report

PREREG = Path(__file__).resolve().parents[1] / "data" / "prereg.yaml"


def _peers_dir(root: Path, rate: float, *, peer: str = "vattention") -> Path:
    """A ``tracesim peers``-shaped output: every C10 configuration, 10 sequences x 100 rows,
    violating the bound at about ``rate``."""
    pre = load_prereg(PREREG)
    rows = []
    for want in pre.claims["C10"]["compare"]:
        label = peer + "(" + ",".join(f"{k}={want[k]:g}" for k in (
            "sinks", "local", "heavy", "base_rate", "epsilon", "delta")) + ")"
        for s in range(10):
            for j in range(100):
                rows.append({"sequence_id": f"s{s}", "peer": peer, "config_id": label,
                             "kept_tokens": 9.0, "peer_den_ok": 1.0,
                             "peer_bound_ok": float(j >= rate * 100 + (s % 2))})
    d = root / f"peers-{peer}-{rate}"
    d.mkdir()
    pq.write_table(pa.Table.from_pandas(pd.DataFrame(rows)), d / "peers.parquet")
    (d / "peers.json").write_text(json.dumps({"peers": [peer], "rows": len(rows)}))
    return d


@pytest.mark.parametrize("rate, verdict", [(0.02, SUPPORTED), (0.6, NOT_SUPPORTED)])
def test_the_report_evaluates_c10_from_peers_output(tmp_path, rate, verdict):
    d = _peers_dir(tmp_path, rate)
    report = build_report(None, None, prereg_path=PREREG, peers_dirs=[d])
    c10 = {c.claim: c for c in report.claims}["C10"]
    pre = load_prereg(PREREG)
    direct = evaluate_c10(pd.read_parquet(d / "peers.parquet"), pre.claims["C10"],
                          pre.claim_alpha("C10"))
    assert c10.verdict == direct["verdict"] == verdict
    rates = [c["violation_rate"] for c in direct["configs"]]
    assert c10.estimate in rates and c10.ci_low <= c10.estimate <= c10.ci_high
    assert c10.extra["configs"] == direct["configs"]
    assert np.isnan(c10.pvalue) and np.isnan(c10.adjusted_pvalue)  # a bound rule, no Holm
    assert any("peers.parquet (C10) records no sha256" in n for n in report.notes)
    write_report(report, tmp_path / "r")
    saved = {c["claim"]: c for c in json.loads((tmp_path / "r" / "claims.json").read_text())}
    assert saved["C10"]["verdict"] == verdict


def test_c10_says_which_input_is_missing(tmp_path):
    bare = {c.claim: c for c in build_report(None, None, prereg_path=PREREG).claims}["C10"]
    assert bare.verdict == NOT_EVALUATED and bare.detail == INPUT_MISSING["peers"]
    other = _peers_dir(tmp_path, 0.02, peer="magicpig")  # peers output without vAttention
    c10 = {c.claim: c for c in build_report(None, None, prereg_path=PREREG,
                                            peers_dirs=[other]).claims}["C10"]
    assert c10.verdict == NOT_EVALUATED and "no rows of vattention(" in c10.detail


def test_peers_output_is_checked_before_use(tmp_path):
    d = _peers_dir(tmp_path, 0.02)
    (d / "peers.json").write_text(json.dumps({"rows": 7}))
    with pytest.raises(ValueError, match="expected the 7 that peers.json records"):
        build_report(None, None, prereg_path=PREREG, peers_dirs=[d])
    with pytest.raises(ValueError, match="no peers.parquet"):
        build_report(None, None, prereg_path=PREREG, peers_dirs=[tmp_path])


def test_c1_and_c2_leave_the_per_step_rows_to_c9():
    rng = np.random.default_rng(3)
    rows = []
    for s in range(6):
        for design in ("poisson", "topk"):
            for _row in range(40):
                rows.append({"sequence_id": f"s{s}", "score": "snapkv", "budget": 0.25,
                             "design": design, "schedule": "oneshot",
                             "correction": "hajek" if design == "poisson" else "none",
                             "certified": design == "poisson", "cert2": 1.0,
                             "wald_cov": float(rng.random() < 0.9), "tail_size": 40,
                             "n_eff": 20.0, "tail_out_mass": 0.1,
                             "rel_err": rng.gamma(2.0) / 10})
    prefill = pd.DataFrame(rows)
    # per-step rows: same designs, wildly different numbers; they must not move C1 or C2
    step = prefill.assign(schedule="step", score="perstep", wald_cov=0.0, rel_err=9.0)
    both = pd.concat([prefill, step], ignore_index=True)
    pre = load_prereg(PREREG)
    c1_prefill, c1_both = evaluate_c1(prefill, pre)[0], evaluate_c1(both, pre)[0]
    assert (c1_both.estimate, c1_both.ci_low, c1_both.ci_high, c1_both.detail) == (
        c1_prefill.estimate, c1_prefill.ci_low, c1_prefill.ci_high, c1_prefill.detail)
    c2_prefill, c2_both = evaluate_c2_attention(prefill, pre), evaluate_c2_attention(both, pre)
    assert (c2_both.estimate, c2_both.pvalue, c2_both.detail) == (
        c2_prefill.estimate, c2_prefill.pvalue, c2_prefill.detail)


def test_report_cli_takes_several_peers_outputs():
    from tracesim.app.cli import build_parser

    args = build_parser("*").parse_args(["report", "res", "--peers", "p1", "--peers", "p2",
                                         "--out", "r"])
    assert args.peers == ["p1", "p2"] and args.results == "res" and args.outcomes is None


def test_the_report_plots_per_step_designs_against_memory_and_bytes(tmp_path):
    from tests.replay_fixtures import build_store
    from tracesim.integrity import sign_results
    from tracesim.policies import make_policy, policy_grid
    from tracesim.replay import replay
    from tracesim.store import open_store

    store = open_store(build_store(tmp_path / "store", n_seqs=2, n_layers=1))
    pols = [make_policy("perstep", d, 0.4, schedule="step",
                        score_params={"proxy": "quant:4", "window": 8})
            for d in ("topk", "poisson")]
    pols.append(make_policy("snapkv", "poisson", 0.4, score_params={"window": 8}))
    pols += policy_grid(["full"], ["topk"], [1.0])  # the demo's sweep holds the full cache too
    res = tmp_path / "results"
    res.mkdir()
    pq.write_table(replay(store, pols, seeds=3, progress=False), res / "results.parquet")
    (res / "summary.json").write_text(json.dumps({"prereg": {"sha256": prereg_hash(PREREG)}}))
    sign_results(res / "results.parquet")
    report = build_report(res, None, prereg_path=PREREG)
    assert "perstep_frontier" in report.figures
    table = report.tables["per-step designs"]
    assert "step_read_kib" in table and "hbm_kib" in table
    write_report(report, tmp_path / "r")
    assert (tmp_path / "r" / "perstep_frontier.png").is_file()
    # the report's first section after the provenance is the per-step result
    md = (tmp_path / "r" / "report.md").read_text()
    sections = [line for line in md.splitlines() if line.startswith("## ")]
    assert sections[0] == "## per-step designs" and sections[1] == "## Claims"
    page = (tmp_path / "r" / "report.html").read_text()
    assert page.index("<h2>per-step designs</h2>") < page.index("<h2>Claims</h2>")
