"""Peers replayed as their reference code defines them (``docs/peers.md``).

==============  ===========================================================================
peer            rule (source)
==============  ===========================================================================
``magicpig``    SimHash K x L of centred keys, used when colliding in >= 2 tables, logit
                ``- log u`` (``Infini-AI-Lab/MagicPIG``)
``vattention``  sinks + local + oracle top-k, then uniform draws with replacement, the number
                set per head by the (epsilon, delta) rule (``xAlg-ai/sparse-attention-hub``)
``quest``       top-k pages by the page upper bound, plain softmax (``mit-han-lab/Quest``)
==============  ===========================================================================
"""

from __future__ import annotations

from tracesim.peers.base import Peer, StepInput, hajek_step_metrics, peer_uniforms
from tracesim.peers.magicpig import (
    MAX_REPLICATES,
    MagicPIG,
    collision_probability,
    replicate_hyperplanes,
)
from tracesim.peers.quest import Quest
from tracesim.peers.run import PEER_COLUMNS, replay_peers, step_inputs
from tracesim.peers.vattention import VAttention, vattention_budget

__all__ = ["MAX_REPLICATES", "PEERS", "PEER_COLUMNS", "MagicPIG", "Peer", "Quest", "StepInput",
           "VAttention", "collision_probability", "hajek_step_metrics", "make_peer",
           "peer_uniforms", "replay_peers", "replicate_hyperplanes", "step_inputs",
           "vattention_budget"]

PEERS = {cls.name: cls for cls in (MagicPIG, VAttention, Quest)}


def make_peer(name: str, **params) -> Peer:
    """Build a peer by name; unknown names and bad parameters raise ``ValueError``."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; expected one of {sorted(PEERS)}")
    try:
        return PEERS[name](**params)
    except TypeError as exc:
        raise ValueError(f"peer {name}: {exc}") from None
