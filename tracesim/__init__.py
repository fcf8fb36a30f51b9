"""tracesim: simulation and statistics over recorded attention traces.

The statistical core (inclusion designs, permanent random numbers, the Hájek attention estimator
and its error certificates) is importable without torch; so are the trace store and the replay
engine. Only :mod:`capture` needs torch.

The public names below are loaded on first use (module ``__getattr__``), so ``import tracesim``
does not pull in numba, scipy or pyarrow until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tracesim.version import __version__

# public name -> module that defines it
_LAZY: dict[str, str] = {
    "OutputSpaceCertificate": "tracesim.certificates",
    "bootstrap_certificate": "tracesim.certificates",
    "output_space_certificate": "tracesim.certificates",
    "satterthwaite_covered": "tracesim.interval_events",
    "wald_covered": "tracesim.interval_events",
    "Bernoulli": "tracesim.designs",
    "Design": "tracesim.designs",
    "OrderSampling": "tracesim.designs",
    "PoissonPPS": "tracesim.designs",
    "TopK": "tracesim.designs",
    "inclusion_probabilities": "tracesim.designs",
    "make_design": "tracesim.designs",
    "AttentionEstimate": "tracesim.estimators",
    "full_attention": "tracesim.estimators",
    "hajek_attention": "tracesim.estimators",
    "permanent_uniforms": "tracesim.prn",
    "ModelMeta": "tracesim.store",
    "TraceStore": "tracesim.store",
    "TraceWriter": "tracesim.store",
    "open_store": "tracesim.store",
    "validate_store": "tracesim.store",
    "replay": "tracesim.replay",
    "register_design": "tracesim.plugins",
    "register_proxy": "tracesim.plugins",
    "register_score": "tracesim.plugins",
}

__all__ = [
    "AttentionEstimate",
    "Bernoulli",
    "Design",
    "ModelMeta",
    "OrderSampling",
    "OutputSpaceCertificate",
    "PoissonPPS",
    "TopK",
    "TraceStore",
    "TraceWriter",
    "__version__",
    "bootstrap_certificate",
    "full_attention",
    "hajek_attention",
    "inclusion_probabilities",
    "make_design",
    "open_store",
    "output_space_certificate",
    "permanent_uniforms",
    "register_design",
    "register_proxy",
    "register_score",
    "replay",
    "satterthwaite_covered",
    "validate_store",
    "wald_covered",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from tracesim.certificates import (
        OutputSpaceCertificate,
        bootstrap_certificate,
        output_space_certificate,
    )
    from tracesim.designs import (
        Bernoulli,
        Design,
        OrderSampling,
        PoissonPPS,
        TopK,
        inclusion_probabilities,
        make_design,
    )
    from tracesim.estimators import AttentionEstimate, full_attention, hajek_attention
    from tracesim.interval_events import satterthwaite_covered, wald_covered
    from tracesim.prn import permanent_uniforms
    from tracesim.replay import replay
    from tracesim.store import ModelMeta, TraceStore, TraceWriter, open_store, validate_store


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tracesim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
