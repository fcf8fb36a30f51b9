"""``data/sweeps/evict-kvpress.yaml``, the grid of the kvpress side-by-side recipe
(``docs/evict.md``, "Checking against kvpress"): it parses to the full cache and the three press
aliases at kvpress's ratios 0.5 and 0.75 (budgets 0.5 and 0.25)."""

from __future__ import annotations

from pathlib import Path

from tracesim.policies.grid import parse_grid
from tracesim.safeio import read_yaml

GRID = Path(__file__).resolve().parents[1] / "data" / "sweeps" / "evict-kvpress.yaml"


def test_kvpress_recipe_grid_is_the_presses_at_kvpress_ratios():
    policies = parse_grid(read_yaml(GRID, "evict grid")["grid"])
    names = sorted((p.score.name, p.budget.value) for p in policies if p.score.name != "full")
    assert [p.score.name for p in policies].count("full") == 1
    assert names == sorted((press, budget)
                           for press in ("KnormPress", "SnapKVPress", "StreamingLLMPress")
                           for budget in (0.5, 0.25))
    assert all(p.row()["design"] == "topk" for p in policies if p.score.name != "full")
