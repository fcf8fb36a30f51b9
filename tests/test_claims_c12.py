"""C12's evaluator: per model a paired TOST over sequences of accuracy (confkv - fixed), the
larger p over the models, and the pre-registered verdict rules."""

from pathlib import Path

import numpy as np
import pandas as pd
from tracesim.analysis.claims import (
    INCONCLUSIVE,
    NOT_EVALUATED,
    NOT_SUPPORTED,
    SUPPORTED,
    ClaimInputs,
)
from tracesim.analysis.claims_c12 import c12_claim
from tracesim.analysis.equivalence import paired_tost
from tracesim.analysis.prereg import load_prereg

PREREG = load_prereg(Path(__file__).resolve().parents[1] / "data" / "prereg.yaml")
MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3-270m": "gemma3-270m"}


def _rows(model_id, conf, fixed, n=32):
    rows = []
    for i in range(n):
        for score, acc, kept in (("confkv", conf[i], 300.0), ("confkv_fixed", fixed[i], 301.0),
                                 ("streaming", False, 300.0), ("full", True, 1536.0)):
            rows.append({"model_id": model_id, "sequence_id": f"s{i}", "score": score,
                         "correct": bool(acc), "full_correct": True,
                         "kept_tokens_mean": kept})
    return rows


def _evaluate(rows):
    return c12_claim(ClaimInputs(prereg=PREREG, outcomes=pd.DataFrame(rows)))


def test_equal_accuracy_on_both_models_is_supported():
    same = [True] * 30 + [False] * 2
    res = _evaluate(_rows(MODELS["smollm2"], same, same) + _rows(MODELS["gemma3-270m"], same,
                                                                 same))
    assert res.verdict == SUPPORTED and res.pvalue == 0.0
    assert res.extra["models"]["smollm2"]["accuracy_streaming"] == 0.0


def test_the_larger_p_and_the_ci_rules():
    rng = np.random.default_rng(0)
    a, b = rng.random(32) < 0.7, rng.random(32) < 0.7
    same = [True] * 32
    res = _evaluate(_rows(MODELS["smollm2"], same, same) + _rows(MODELS["gemma3-270m"], a, b))
    expected = paired_tost(a.astype(float), b.astype(float), 0.05, alpha=0.05)
    assert res.pvalue == expected.pvalue and res.estimate == expected.mean_difference
    assert res.verdict == INCONCLUSIVE  # noisy model: neither equivalent nor outside
    better = [True] * 32
    worse = [False] * 24 + [True] * 8
    res = _evaluate(_rows(MODELS["smollm2"], better, worse)
                    + _rows(MODELS["gemma3-270m"], same, same))
    assert res.verdict == NOT_SUPPORTED and res.ci_low > 0.05


def test_one_model_only_or_none_is_not_a_verdict():
    same = [True] * 32
    res = _evaluate(_rows(MODELS["smollm2"], same, same))
    assert res.verdict == INCONCLUSIVE and res.pvalue == 1.0 and "gemma3-270m: 0" in res.detail
    assert _evaluate(_rows("x", same, same)[:0]).verdict == NOT_EVALUATED
