"""Proxies of each decode step's attention, for per-step designs (one small file each).

==============  ========================================================  =====================
spec            what fast memory holds                                    bits/token/KV head
==============  ========================================================  =====================
``exact``       the full keys (reference, not deployable)                 ``16 d``
``quant:b[,g]`` keys at ``b`` in {1,2,4,8} bits, per channel, groups g    ``d (b + 32/g)``
``lowrank:r``   ``r`` coefficients on a prefill-key basis (Loki-style)    ``16 r``
``pages:P``     Quest's per-page min/max keys                             ``32 d / P``
``simhash:K,L`` ``K L`` SimHash bits of centred keys + norm (MagicPIG)    ``K L + 16``
==============  ========================================================  =====================

:func:`make_proxy` parses a spec string; :data:`PROXIES` maps the built-ins' names to classes,
and :data:`~tracesim.registry.PROXY_REGISTRY` adds plugins (entry points ``tracesim.proxies``,
:func:`~tracesim.registry.register_proxy`). A spec is ``name`` or ``name:v1,v2,...``: the values
are positive integers, given to the proxy's dataclass fields in their order (``quant:4,32`` =
bits 4, group 32).
"""

from __future__ import annotations

from dataclasses import fields

from tracesim.proxies.base import Proxy
from tracesim.proxies.exact import ExactProxy
from tracesim.proxies.lowrank import LowRankProxy
from tracesim.proxies.pages import PageProxy, page_upper_bounds
from tracesim.proxies.quant import QuantProxy, quantise_keys
from tracesim.proxies.simhash import SimHashProxy, hyperplanes
from tracesim.registry import PROXY_REGISTRY

__all__ = ["PROXIES", "ExactProxy", "LowRankProxy", "PageProxy", "Proxy", "QuantProxy",
           "SimHashProxy", "hyperplanes", "make_proxy", "page_upper_bounds", "quantise_keys"]

PROXIES: dict[str, type[Proxy]] = {cls.name: cls for cls in (
    ExactProxy, QuantProxy, LowRankProxy, PageProxy, SimHashProxy)}
PROXY_REGISTRY.install(PROXIES, Proxy)


def make_proxy(spec: str | Proxy) -> Proxy:
    """Build a proxy from its spec, e.g. ``"quant:4"``, ``"simhash:10,150"``.

    Raises
    ------
    ValueError
        Naming the spec and what was expected.
    """
    if isinstance(spec, Proxy):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"proxy {spec!r}: expected a string such as 'quant:4'")
    name, _, rest = spec.strip().partition(":")
    try:
        cls = PROXY_REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown proxy {spec!r}; expected one of "
                         f"{sorted(PROXY_REGISTRY.names())} (e.g. 'exact', 'quant:4', "
                         "'lowrank:16', 'pages:16', 'simhash:10,150')") from None
    names = tuple(f.name for f in fields(cls))  # the spec's positional parameters, in order
    values = [v.strip() for v in rest.split(",")] if rest else []
    if len(values) > len(names):
        raise ValueError(f"proxy {spec!r}: {name} takes at most {len(names)} parameter(s) "
                         f"{names}")
    params = {}
    for f, v in zip(names, values, strict=False):
        if not v.isdigit() or len(v) > 9:
            raise ValueError(f"proxy {spec!r}: {f} = {v!r}: expected a positive integer")
        params[f] = int(v)
    return cls(**params)
