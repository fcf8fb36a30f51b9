"""Deterministic error bounds from page summaries of the tokens a policy does not keep.

:mod:`tracesim.bounds.pages` builds the summaries and the per-page logit bounds;
:mod:`tracesim.bounds.bound` turns them into a bound on ``|o_hat - o|`` that holds for every
estimator and every draw (``docs/math.md``, section 9).
"""

from tracesim.bounds.bound import ROUNDING, BoundResult, attention_error_bound, ratio_box_max
from tracesim.bounds.pages import (
    PageSummaries,
    build_page_summaries,
    logit_lower_bounds,
    logit_upper_bounds,
    page_numbers,
    summary_tokens,
)

__all__ = ["ROUNDING", "BoundResult", "PageSummaries", "attention_error_bound", "ratio_box_max",
           "build_page_summaries", "logit_lower_bounds", "logit_upper_bounds",
           "page_numbers", "summary_tokens"]
