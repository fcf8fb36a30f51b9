"""tracesim: simulation and statistics over recorded attention traces.

The statistical core (inclusion designs, permanent random numbers, the Hájek attention estimator
and its error certificates) is importable without torch; so are the trace store and the replay
engine. Only :mod:`capture` needs torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

from tracesim.certificates import (
    OutputSpaceCertificate,
    bootstrap_certificate,
    output_space_certificate,
)
from tracesim.coverage import satterthwaite_covered, wald_covered
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
from tracesim.plugins import register_design, register_score
from tracesim.prn import permanent_uniforms
from tracesim.store import ModelMeta, TraceStore, TraceWriter, open_store, validate_store

__all__ = [
    "AttentionEstimate",
    "Bernoulli",
    "ModelMeta",
    "TraceStore",
    "TraceWriter",
    "Design",
    "OrderSampling",
    "OutputSpaceCertificate",
    "PoissonPPS",
    "TopK",
    "__version__",
    "bootstrap_certificate",
    "full_attention",
    "hajek_attention",
    "inclusion_probabilities",
    "make_design",
    "open_store",
    "replay",
    "output_space_certificate",
    "permanent_uniforms",
    "register_design",
    "register_score",
    "satterthwaite_covered",
    "validate_store",
    "wald_covered",
]



def __getattr__(name: str):
    # The replay engine is loaded on first use so `import tracesim` stays light.
    if name == "replay":
        from tracesim.replay import replay

        return replay
    raise AttributeError(f"module 'tracesim' has no attribute {name!r}")
