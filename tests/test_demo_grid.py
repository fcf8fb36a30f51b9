"""The demo runs what its report evaluates: the per-step designs C9 compares and the vAttention
configurations of C10 (a fresh clone's ``make demo`` prints both evaluated)."""

from __future__ import annotations

from pathlib import Path

from tracesim.analysis.claims_perstep import _vattention_label
from tracesim.analysis.prereg import load_prereg

from tracesim.app.demo import DEMO_PEERS, SCALES, sweep_spec
from tracesim.peers import make_peer
from tracesim.policies.grid import expand_grid

PREREG = Path(__file__).resolve().parents[1] / "data" / "prereg.yaml"


def _one(policies, want):
    def ok(p):
        s, d = p.score, p.design
        return (s.name == want["score"] and getattr(s, "proxy", None) == want["proxy"]
                and d.name == want["design"] and p.budget.value == want["budget"]
                and p.schedule.label().startswith(want["schedule"])
                and all(getattr(s, k, getattr(d, k, None)) == want[k]
                        for k in ("gqa", "top_fraction", "mixture") if k in want))
    return [p.id for p in policies if ok(p)]


def test_demo_sweep_holds_c9s_designs_once_each(tmp_path):
    claim = load_prereg(PREREG).claims["C9"]
    for scale in SCALES.values():
        spec = sweep_spec(scale, tmp_path / "t", tmp_path / "o", None, n_layers=30)
        policies = expand_grid(spec["grid"]).policies
        for role in ("primary", "baseline"):
            assert len(_one(policies, claim["compare"][role])) == 1, role
        assert any(p.score.name == "snapkv" and p.design.name == "poisson" for p in policies)
    small = sweep_spec(SCALES["small"], tmp_path / "t", tmp_path / "o", None, n_layers=30)
    assert small["layers"] == {"start": 0, "stop": 30, "step": 3}


def test_demo_peers_are_c10s_configurations():
    labels = {make_peer(name, **params).label() for name, params in DEMO_PEERS}
    for want in load_prereg(PREREG).claims["C10"]["compare"]:
        assert _vattention_label(want) in labels
