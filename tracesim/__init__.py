"""tracesim: simulation and statistics over recorded attention traces.

The statistical core (inclusion designs, permanent random numbers, the Hájek attention estimator
and its error certificates) is importable without torch; so are the trace store and the replay
engine. Only :mod:`capture` needs torch.
"""

from __future__ import annotations

__version__ = "0.1.0"
