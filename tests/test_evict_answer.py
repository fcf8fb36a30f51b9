"""The answer span of the in-loop runs: located exactly, and the share of it each run kept."""

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
from tracesim.capture.inloop.answer import (
    ANSWER_COLUMNS,
    answer_columns,
    locate_answer,
    sequence_answer,
)
from tracesim.capture.inloop.evict import decode_policy, layer_plans, outcome_row
from tracesim.capture.models import load_tokenizer
from tracesim.capture.tasks import build_prompt

from tests.evict_fixtures import prefilled
from tracesim.columns import COLUMN_DOCS, nullify_rows
from tracesim.policies import make_policy

pytestmark = pytest.mark.capture


@pytest.mark.parametrize(("task", "n_occurrences"), [("passkey", 2), ("multikey", 1),
                                                      ("vartrack", 1), ("kvret", 1)])
def test_the_span_is_the_gold_digits_inside_the_needle(task, n_occurrences):
    tok = load_tokenizer()
    for seed in range(4):
        p = build_prompt(tok, task, 400, seed)
        span = locate_answer(p.token_ids, p.context_start, p.context_end, p.gold, p.task, tok)
        assert span is not None and len(span.occurrences) == n_occurrences
        for occ in span.occurrences:
            assert p.context_start <= occ[0] and occ[-1] < p.context_end
            assert np.array_equal(occ, np.arange(occ[0], occ[-1] + 1))  # contiguous tokens
            assert tok.decode([p.token_ids[i] for i in occ]).strip() == p.gold
            # exactly the digits: the first and the last token carry the first and last digit
            assert tok.decode([p.token_ids[occ[0]]]).strip()[0] == p.gold[0]
            assert tok.decode([p.token_ids[occ[-1]]]).strip()[-1] == p.gold[-1]
        if task == "multikey":  # the distractor needles' numbers are not the answer
            assert p.context.count(p.gold) == 1


def test_no_span_where_the_answer_is_unknown():
    tok = load_tokenizer()
    p = build_prompt(tok, "passkey", 300, 1)
    args = (p.token_ids, p.context_start, p.context_end)
    assert locate_answer(*args, None, p.task, tok) is None  # no gold (user prompts)
    assert locate_answer(*args, "the key", p.task, tok) is None  # not a number
    assert locate_answer(*args, p.gold, "my-prompts", tok) is None  # not a generated task
    assert locate_answer(*args, p.gold[:-1], p.task, tok) is None  # only inside a number
    assert locate_answer(*args, "99999999", p.task, tok) is None  # not in the context
    assert locate_answer(*args, p.gold, p.task, None) is None


def test_stored_sequences_have_their_span(tiny_store):
    store, loaded, seq, meta, P, pre = prefilled(tiny_store)
    span = sequence_answer(meta, loaded.tokenizer)
    ids = list(meta["token_ids"])
    assert [loaded.tokenizer.decode([ids[i] for i in occ]).strip()
            for occ in span.occurrences] == [meta["gold"]] * 2


def _row(store, loaded, meta, policy, res):
    return outcome_row(dict(meta, sequence_id="s"), policy, 0, res, loaded.tokenizer,
                       store.model.n_layers, n_kv=store.model.n_kv_heads,
                       head_dim=store.model.head_dim)


@pytest.mark.parametrize("design", ["topk", "poisson"])
def test_full_budget_keeps_the_whole_span(tiny_store, design):
    store, loaded, seq, meta, P, pre = prefilled(tiny_store)
    pre.answer = sequence_answer(meta, loaded.tokenizer)
    policy = make_policy("snapkv", design, 1.0, score_params={"window": 8})
    res = decode_policy(loaded.model, pre, layer_plans(pre.traces, policy, 0), 3, set(),
                        policy, 0)
    row = _row(store, loaded, meta, policy, res)
    assert row["answer_tokens"] == 10
    for col in ("answer_kept_share", "answer_kept_min", "answer_first_kept_share",
                "answer_last_kept_share"):
        assert row[col] == 1.0
    assert row["answer_kept_by_head"] == [1.0] * (store.model.n_layers * store.model.n_kv_heads)
    if design == "poisson":
        assert row["answer_pi_mean"] == 1.0
    else:
        assert math.isnan(row["answer_pi_mean"]) and row["answer_pi_by_head"] == []


def test_a_policy_that_keeps_none_of_the_span_gives_zero(tiny_store):
    # Streaming keeps the sinks and the last tokens; this needle sits mid-context.
    store, loaded, seq, meta, P, pre = prefilled(tiny_store)
    pre.answer = sequence_answer(meta, loaded.tokenizer)
    policy = make_policy("streaming", "topk", 0.05, score_params={"window": 4})
    plans = layer_plans(pre.traces, policy, 0)
    kept = np.flatnonzero(plans[0].kept.numpy().any(axis=0))
    assert np.intersect1d(kept, pre.answer.positions).size == 0
    row = _row(store, loaded, meta, policy, decode_policy(loaded.model, pre, plans, 3, set(),
                                                          policy, 0))
    assert row["answer_kept_share"] == row["answer_kept_min"] == 0.0
    assert row["answer_first_kept_share"] == row["answer_last_kept_share"] == 0.0


@pytest.mark.parametrize(("policy", "steps"), [
    (make_policy("snapkv", "poisson", 0.3, score_params={"window": 8}), 1),
    (make_policy("h2o", "poisson", 0.4, schedule="decode:2", score_params={"window": 8}), 3),
    (make_policy("perstep", "poisson", 0.3, schedule="step",
                 score_params={"window": 8, "proxy": "exact"}), 3)])
def test_shares_are_the_kept_flags_of_the_span_tokens(tiny_store, policy, steps):
    store, loaded, seq, meta, P, pre = prefilled(tiny_store)
    pre.answer = span = sequence_answer(meta, loaded.tokenizer)
    plans = layer_plans(pre.traces, policy, 2)
    res = decode_policy(loaded.model, pre, plans, 4, set(), policy, 2)
    L, H = store.model.n_layers, store.model.n_kv_heads
    assert res.answer_kept.shape == res.answer_pi.shape == (steps, L, H, span.positions.size)
    row = _row(store, loaded, meta, policy, res)
    if policy.schedule.kind == "oneshot":  # straight from the plans
        want = np.array([[plans[layer].kept[h, span.positions].double().mean().item()
                          for h in range(H)] for layer in range(L)])
        np.testing.assert_allclose(row["answer_kept_by_head"], want.ravel(), rtol=0, atol=1e-15)
        pis = [plans[layer].pi[:, span.positions].mean().item() for layer in range(L)]
        assert row["answer_pi_mean"] == pytest.approx(np.mean(pis), rel=1e-12)
    by_head = np.array(row["answer_kept_by_head"])
    assert row["answer_kept_share"] == pytest.approx(by_head.mean(), rel=1e-12)
    assert row["answer_kept_min"] == by_head.min() and 0 <= by_head.min() <= 1
    assert 0 < row["answer_pi_mean"] < 1 and len(row["answer_pi_by_head"]) == L * H


def test_no_span_gives_null_columns(tiny_store):
    store, loaded, seq, meta, P, pre = prefilled(tiny_store)
    assert pre.answer is None  # a prefill without a located span
    policy = make_policy("snapkv", "poisson", 0.3, score_params={"window": 8})
    res = decode_policy(loaded.model, pre, layer_plans(pre.traces, policy, 0), 2, set(),
                        policy, 0)
    table = nullify_rows([_row(store, loaded, meta, policy, res)])
    assert all(table.column(c).null_count == 1 for c in ANSWER_COLUMNS)
    assert answer_columns(None, None, None)["answer_tokens"] is None


def test_run_evict_writes_the_answer_columns_and_the_report_table(tiny_store, tmp_path):
    from tracesim.analysis.answer_span import add_to_report, answer_span_table
    from tracesim.capture.inloop.evict_run import run_evict

    from tracesim.peers import make_peer

    path, loaded = tiny_store
    policies = [make_policy("snapkv", "topk", 0.3, score_params={"window": 8}),
                make_policy("streaming", "topk", 0.05, score_params={"window": 4}),
                make_policy("full")]
    run_evict(path, policies, seeds=1, out=tmp_path / "o", model=loaded, progress=False,
              peers=[make_peer("quest", page=1, budget=1.0)])
    table = pq.read_table(tmp_path / "o" / "outcomes.parquet")
    assert all(c in table.column_names and c in COLUMN_DOCS for c in ANSWER_COLUMNS)
    df = table.to_pandas()
    assert (df.answer_tokens == 10).all()
    full = df[df.score.isin(["full", "peer"])]  # quest at budget 1 reads every page
    assert (full.answer_kept_share == 1).all() and (full.answer_kept_min == 1).all()
    assert (df[df.score == "streaming"].answer_kept_share == 0).all()
    assert df.answer_pi_mean.isna().all()  # no randomized design in this grid
    summary = answer_span_table(df)
    assert summary.loc[("full", "none", "none", np.nan), "whole_kept_runs"] == 2
    assert summary.loc[("streaming", "topk", "none", 0.05), "whole_kept_runs"] == 0

    class Report:
        tables: dict = {}

    add_to_report(Report, df)
    assert "first_digit_kept" in next(iter(Report.tables.values()))


def test_the_span_and_its_table_import_without_torch():
    import subprocess
    import sys

    code = ("import sys, tracesim.capture.inloop.answer, tracesim.analysis.answer_span; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
