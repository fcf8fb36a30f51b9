"""Inclusion designs: from tail scores and a budget to inclusion probabilities and kept sets.

=================  ===========================================  ==========  ===========
name               class                                        randomized  variance
=================  ===========================================  ==========  ===========
``poisson``        :class:`PoissonPPS` (capped PPS, mixture)    yes         poisson
``bernoulli``      :class:`Bernoulli` (uniform)                 yes         poisson
``fixed``          :class:`OrderSampling` (Pareto / sequential)  yes         fixed
``topk``           :class:`TopK` (deterministic)                no          none
=================  ===========================================  ==========  ===========
"""

from __future__ import annotations

from typing import Any

from tracesim.designs.base import Design, validate_budget, validate_scores
from tracesim.designs.bernoulli import Bernoulli
from tracesim.designs.order import OrderSampling
from tracesim.designs.poisson import PoissonPPS, inclusion_probabilities
from tracesim.designs.topk import TopK
from tracesim.registry import DESIGN_REGISTRY

__all__ = [
    "DESIGNS",
    "DESIGN_REGISTRY",
    "Bernoulli",
    "Design",
    "OrderSampling",
    "PoissonPPS",
    "TopK",
    "inclusion_probabilities",
    "make_design",
    "validate_budget",
    "validate_scores",
]

DESIGNS: dict[str, type[Design]] = {
    cls.name: cls for cls in (PoissonPPS, Bernoulli, OrderSampling, TopK)
}
#: Built-ins + plugins (entry points ``tracesim.designs``, decorator); see tracesim.registry.
DESIGN_REGISTRY.install(DESIGNS, Design)


def make_design(name: str, **params: Any) -> Design:
    """Build a design from its registry name and hyperparameters (e.g. from a sweep spec)."""
    return DESIGN_REGISTRY.build(name, params)
