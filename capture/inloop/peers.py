"""Peers in the loop: MagicPIG, vAttention and Quest inside the model, as their code defines them.

A peer (:mod:`tracesim.peers`, ``docs/peers.md``) is not a policy: it picks its tokens per query
head and attends with its own estimator (MagicPIG's ``-log(u + 1e-4)`` weights over its
collision set, vAttention's draws with replacement, Quest's plain softmax over its pages), so
it does not fit the per-KV-head bias plus Hájek offset of
:class:`tracesim.capture.inloop.enforce.EvictionState`. :class:`PeerState` therefore computes each
decode step's attention output itself: for every query head it builds the
:class:`tracesim.peers.StepInput` of that step (float64, the cache ``[0, t]`` with the current
token) and returns the peer's own estimate (:meth:`tracesim.peers.Peer.attend`): the very
code ``tracesim peers`` replays, now on the queries generated under the peer. The prefill
attends to the full cache; per-(layer, KV head) state (MagicPIG's hash codes of the prefill
range) is built at the first decode step from the prefill keys, which are those of the
full-cache run.

Outcome rows carry ``score = "peer"``, ``design`` the peer's name and ``config_id`` its label;
the step cost columns count, per KV head, the union of the tokens of ``[0, t)`` its query heads
attend (:func:`peer_step_columns`). Peers report no serving-time certificate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy import special
from tracesim.capture.attention import CaptureState

from tracesim.peers import Peer, StepInput

__all__ = ["PeerConfig", "PeerState", "decode_peer", "named_params", "peer_step_columns",
           "peers_from_cli", "summary_bits"]


def named_params(names: str | None, params_json: str, option: str,
                 mapping: str) -> tuple[list[str], dict] | None:
    """The names of ``--OPTION NAMES`` and the JSON of ``--OPTION-params``: ``(names,
    {name: fields})``, or None when neither is given. ``mapping`` describes the expected JSON
    in the error message (e.g. ``{peer: {parameter: value}}``).

    Raises
    ------
    tracesim.errors.UsageError
        Parameters without names, JSON that is not that mapping (exit status 2).
    """
    from tracesim.errors import UsageError
    from tracesim.safeio import loads_json

    if names is None:
        if params_json != "{}":
            raise UsageError(f"{option}-params: only applies with {option} NAMES")
        return None
    try:
        params = loads_json(params_json, f"{option}-params")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()):
        raise UsageError(f"{option}-params: expected a JSON mapping {mapping}")
    return wanted, params


def peers_from_cli(names: str | None, params_json: str = "{}") -> list[Peer] | None:
    """The peers of ``evict --peer NAMES --peer-params JSON`` (``tracesim peers``' grammar).

    Raises
    ------
    tracesim.errors.UsageError
        Naming the option and the field (exit status 2).
    """
    from tracesim.errors import UsageError
    from tracesim.peers import make_peer

    parsed = named_params(names, params_json, "--peer", "{peer: {parameter: value}}")
    if parsed is None:
        return None
    wanted, params = parsed
    if not wanted or set(params) - set(wanted):
        raise UsageError(f"--peer {names!r} / --peer-params: expected peer names from "
                         "magicpig, vattention, quest, and parameters only for those")
    try:
        return [make_peer(n, **params.get(n, {})) for n in wanted]
    except ValueError as exc:
        raise UsageError(f"--peer: {exc}") from None


def summary_bits(peer: Peer, head_dim: int) -> float:
    """Bits per cached token per KV head a peer reads at every step besides the attended rows:
    MagicPIG's ``K L`` hash bits per hash set (``replicates`` sets) and a 16-bit key norm,
    Quest's fp16 min/max keys per page, vAttention's fp16 keys (its heavy top-k ranks every
    exact logit)."""
    if peer.name == "magicpig":
        return float(peer.replicates * peer.bits * peer.tables + 16)
    if peer.name == "quest":
        return 32.0 * head_dim / peer.page
    return 16.0 * head_dim


def _dense(peer: Peer, t: int, prompt_length: int) -> np.ndarray:
    """Positions of ``[0, t)`` a peer always attends (resident in HBM), bool (t,)."""
    dense = np.zeros(t, dtype=bool)
    if peer.name == "magicpig":
        dense[:peer.sinks] = True
        dense[max(peer.sinks, prompt_length - peer.local):] = True  # and every generated token
    elif peer.name == "vattention":
        dense[:peer.sinks] = True
        dense[max(0, t + 1 - peer.local):] = True
    return dense


@dataclass(frozen=True)
class PeerConfig:
    """A peer as an in-loop configuration: its id and its policy columns."""

    peer: Peer

    @property
    def id(self) -> str:
        return self.peer.label()

    @property
    def needs_seeds(self) -> bool:
        return bool(self.peer.randomized)

    def row(self) -> dict[str, Any]:
        """:data:`tracesim.policies.POLICY_COLUMNS`, null where a peer has no such field."""
        from tracesim.policies import POLICY_COLUMNS

        out: dict[str, Any] = dict.fromkeys(POLICY_COLUMNS)
        out.update(config_id=self.id, score="peer", design=self.peer.name, schedule="step",
                   certified=False, deployable=True, budget=getattr(self.peer, "budget", math.nan))
        return out


class PeerState(CaptureState):
    """Runs a peer's own estimator as every decode step's attention output.

    Attributes
    ----------
    step_positions : list of int
    step_kept : list of ndarray of bool, shape (n_layers, n_heads, t)
        Per decode step, the tokens of ``[0, t)`` each query head attends (layers that have
        not run hold False).
    """

    def __init__(self, prompt_length: int, n_layers: int, peer: Peer, seed: int,
                 alpha: float = 0.05) -> None:
        super().__init__(prompt_length)
        self.peer = peer
        self.seed = int(seed)
        self.n_layers = int(n_layers)
        self.z = float(special.ndtri(1 - alpha / 2))
        self._prepared: dict[tuple[int, int], object] = {}
        self.step_positions: list[int] = []
        self.step_kept: list[np.ndarray] = []

    def attend(self, layer, query, key, value, scaling):
        q_len, kv_len = query.shape[2], key.shape[2]
        if q_len != 1 or kv_len <= self.prompt_length:
            return None
        t = kv_len - 1
        q = query[0, :, 0].double().cpu().numpy()
        keys = key[0].double().cpu().numpy()
        values = value[0].double().cpu().numpy()
        n_heads, n_kv = q.shape[0], keys.shape[0]
        group = n_heads // n_kv
        if not self.step_positions or self.step_positions[-1] != t:
            self.step_positions.append(t)
            self.step_kept.append(np.zeros((self.n_layers, n_heads, t), dtype=bool))
        out = np.empty_like(q)
        for h in range(n_heads):
            g = h // group
            state = self._prepared.get((layer, g))
            if state is None:
                state = self.peer.prepare(layer, g, keys[g], self.prompt_length, self.seed)
                self._prepared[(layer, g)] = state
            s = keys[g] @ q[h] * float(scaling)
            w = np.exp(s - s.max())
            x = StepInput(layer=int(layer), head=h, kv_head=g, step=t,
                          prompt_length=self.prompt_length, query=q[h], keys=keys[g],
                          values=values[g], scale=float(scaling), logits=s,
                          truth=(w @ values[g]) / w.sum())
            _, out[h], kept = self.peer.attend(x, state, self.seed, self.z)
            self.step_kept[-1][layer, h] = kept[:t]
        return torch.from_numpy(out).to(device=query.device, dtype=query.dtype)[None, None]


@torch.inference_mode()
def decode_peer(model: Any, prefill: Any, peer: Peer, max_new_tokens: int, eos_ids: set[int],
                seed: int = 0) -> Any:
    """Greedy decode with ``peer`` attending at every decode step, then crop the cache back.

    Returns a :class:`tracesim.capture.inloop.evict.DecodeResult` (no certificates; ``kept_tokens``:
    prompt tokens each KV head's query heads attend together, mean over steps).
    """
    from tracesim.capture.attention import recording
    from tracesim.capture.generate import decode_greedy
    from tracesim.capture.inloop.evict import DecodeResult, _restore

    P = prefill.prompt_length
    state = PeerState(P, len(prefill.traces), peer, seed)
    try:
        with recording(model, state):
            generated, logprobs = decode_greedy(model, prefill.cache, prefill.logits, P,
                                                max_new_tokens, eos_ids, state=state)
    finally:
        _restore(prefill.cache, P)
    n_kv = prefill.traces[0].n_kv_heads
    union = [_kv_union(k, n_kv) for k in state.step_kept]
    kept = (np.mean([u[:, :, :P].sum(axis=2) for u in union], axis=0) if union
            else np.full((len(prefill.traces), n_kv), P))
    res = DecodeResult(generated, logprobs, bool(generated[-1] in eos_ids), [], kept, [])
    res.step_positions = list(state.step_positions)
    res.step_kept = union
    if prefill.answer is not None:  # span tokens a KV head's query heads read, per step
        res.answer = prefill.answer
        if union:
            res.answer_kept = np.stack([u[:, :, prefill.answer.positions] for u in union])
    return res


def _kv_union(kept: np.ndarray, n_kv: int) -> np.ndarray:
    """(n_layers, n_heads, t) -> (n_layers, n_kv, t): tokens any query head of a group reads."""
    L, H, t = kept.shape
    return kept.reshape(L, n_kv, H // n_kv, t).any(axis=2)


def peer_step_columns(peer: Peer, result: Any, prompt_length: int, head_dim: int,
                      memory: Any = None) -> dict[str, float]:
    """The ``step_*`` columns (:func:`tracesim.capture.inloop.perstep.step_columns`) of a peer's
    run.

    Per KV head the attended tokens are the union over its query heads; rows read from the
    lower tier are those less the peer's dense part (MagicPIG: sinks, the last ``local``
    prefill tokens and every generated one; vAttention: sinks and the last ``local``; Quest:
    none); the summary read every step is :func:`summary_bits` per cached token.
    """
    from tracesim.capture.inloop.perstep import STEP_COLUMNS

    from tracesim.tiers.model import MemoryModel

    memory = memory or MemoryModel()
    if not result.step_positions:
        return dict.fromkeys(STEP_COLUMNS, math.nan)
    b = memory.token_bytes(head_dim)
    bits = summary_bits(peer, head_dim)
    tokens, fractions, rows, nbytes, seconds = [], [], [], [], []
    for t, union in zip(result.step_positions, result.step_kept, strict=True):
        counts = union.sum(axis=2)  # (n_layers, n_kv)
        layer_rows = (union & ~_dense(peer, t, prompt_length)).sum(axis=(1, 2))
        tokens.append(counts.mean())
        fractions.append(counts.mean() / t)
        rows.append(layer_rows.sum())
        nbytes.append(counts.sum() * b + counts.size * t * bits / 8)
        seconds.append(memory.lower[0].fetch_seconds(layer_rows, layer_rows * b).sum())
    return {"step_tokens_mean": float(np.mean(tokens)),
            "step_tokens_fraction": float(np.mean(fractions)),
            "step_rows_read": float(np.mean(rows)), "step_bytes": float(np.mean(nbytes)),
            "step_link_bytes": float(np.mean(rows) * b), "step_us": float(np.mean(seconds) * 1e6)}
