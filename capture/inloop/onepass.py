"""Decode attention and its serving-time certificates in one pass over the retained values.

For one decode query per head, blocked over keys like flash attention, with online-softmax
rescaling, alongside the numerator ``sum_i p_i v_i`` of the attention output it accumulates over
the sampled tail (weights ``w_i = 1 - pi_i``, 0 for take-all, evicted and generated tokens)::

    S0 = sum_i w_i p_i^2,   S1 = sum_i w_i p_i^2 v_i,   S2 = sum_i w_i p_i^2 ||v_i||^2

with ``p_i = exp(s_i - m)`` the unnormalized Hájek weights (logits ``s_i`` include the
``-log pi_i`` offset). With ``a_i = p_i / l`` and the output ``o = sum_i p_i v_i / l``, the
primary certificate is then ``C^2 = (S2 - 2 o . S1 + ||o||^2 S0) / l^2``, the same number as the
two-pass form ``sum_S (1 - pi_i) a_i^2 ||v_i - o||^2``
(:func:`tracesim.capture.inloop.enforce.serving_certificates`). When the running maximum grows from
``m`` to
``m'`` the first-order sums are rescaled by ``alpha = exp(m - m')`` and the second-order ones by
``alpha^2``.

The extra rows share the output's matrix product: per KV head and key block, one ``(rows, B) @
(B, d)`` product gives the output numerator and every certificate sum, so the values are read
once. Optional extras, also in the same product:

* Rosén's fixed-size variance (order sampling): ``sum_i w_i p_i`` and ``sum_i w_i p_i v_i``;
* the per-layer output-space (GQA) certificate: for every pair of heads ``h <= h'`` of a group,
  ``sum_i w_i p_{h,i} p_{h',i}`` (times 1, ``v_i`` and ``q_{hh',i} = v_i^T Gamma_{hh'} v_i``),
  where ``Gamma = W_g^T W_g``; the quadratic forms ``q`` do not depend on the query and are
  computed once per plan (:func:`pair_quadratic_forms`).
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "fixed_size_inflation", "group_queries", "onepass_attention",
           "pair_quadratic_forms", "pairs"]

#: Keys per block. Each block costs a rescale of the accumulators and smaller products run
#: slower on CPU BLAS, so one block covers a 32k cache; the logits buffer it bounds is only
#: ``n_kv x G x BLOCK`` floats (4 MiB at 32 heads).
BLOCK = 32768


def pairs(group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Head pairs ``(h, h')`` with ``h <= h'`` within a group: two ``(G(G+1)/2,)`` long tensors,
    the ``G`` diagonal pairs first."""
    diag = [(h, h) for h in range(group)]
    off = [(h, k) for h in range(group) for k in range(h + 1, group)]
    first, second = zip(*(diag + off), strict=True)
    return torch.tensor(first), torch.tensor(second)


def group_queries(query: torch.Tensor, n_kv: int) -> torch.Tensor:
    """The decode queries ``(H, d)`` grouped by the KV head they attend with: ``(H_kv, G, d)``,
    ``G = H // H_kv`` (GQA: query head ``h`` uses KV head ``h // G``). Both the one-pass and
    the two-pass certificate code read the shapes from it."""
    H, d = query.shape
    if H % n_kv:
        raise ValueError(f"{H} query heads cannot share {n_kv} KV heads, expected a multiple "
                         f"of {n_kv}")
    return query.reshape(n_kv, H // n_kv, d)


def fixed_size_inflation(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rosén's ``m / (m - 1)`` per KV head, ``m`` the number of sampled tail tokens (positive
    ``weight``, shape ``(H_kv, ...)``, summed over the last axis); 0 where ``m <= 1`` (no
    variance estimate from one token)."""
    m_real = (weight > 0).sum(-1).to(dtype)
    return torch.where(m_real > 1, m_real / (m_real - 1).clamp_min(1), torch.zeros_like(m_real))


def pair_quadratic_forms(values: torch.Tensor, gram: torch.Tensor, weight: torch.Tensor
                         ) -> torch.Tensor:
    """``q[g, r, i] = v_{g,i}^T Gamma_{g, h_r h'_r} v_{g,i}`` where ``weight[g, i] > 0``, else 0.

    Parameters
    ----------
    values : (H_kv, T, d)
    gram : (H_kv, G*d, G*d)
    weight : (H_kv, T)
        Only positions with positive weight (the kept tail) are computed.

    Returns
    -------
    (H_kv, G(G+1)/2, T) float32
    """
    n_kv, T, d = values.shape
    G = gram.shape[-1] // d
    first, second = pairs(G)
    out = torch.zeros(n_kv, first.numel(), T, dtype=torch.float32, device=values.device)
    blocks = gram.float().reshape(n_kv, G, d, G, d)
    for g in range(n_kv):
        idx = torch.nonzero(weight[g] > 0).flatten()
        if idx.numel() == 0:
            continue
        v = values[g].index_select(0, idx).float()  # (m, d)
        for r, (h, k) in enumerate(zip(first.tolist(), second.tolist(), strict=True)):
            out[g, r, idx] = ((v @ blocks[g, h, :, k, :]) * v).sum(-1)
    return out


def onepass_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor | None,
    scaling: float,
    *,
    value_sq: torch.Tensor | None = None,
    gram: torch.Tensor | None = None,
    quad: torch.Tensor | None = None,
    fixed_size: bool = False,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Hájek decode attention and its certificates in one blocked pass.

    Parameters
    ----------
    query : (H, d)
        One decode query per head.
    key, value : (H_kv, T, d)
        The cache (every position; evicted ones are masked by ``bias``).
    bias : (H_kv, T)
        Additive logit bias: ``-inf`` evicted, ``-log pi`` kept tail, 0 otherwise.
    weight : (H_kv, T) or None
        ``1 - pi`` on kept tail tokens, 0 elsewhere. None: attention only (no certificate).
    scaling : float
    value_sq : (H_kv, T), optional
        ``||v_i||^2``; computed per block when not given (it does not depend on the query, so a
        caller may cache it per plan).
    gram : (H_kv, G*d, G*d), optional
        ``W_g^T W_g``: also return the output-space certificate; needs ``quad``.
    quad : (H_kv, G(G+1)/2, T), optional
        :func:`pair_quadratic_forms` of the values.
    fixed_size : bool
        Rosén's fixed-size variance for the primary certificate (order sampling); the
        output-space certificate keeps the Poisson form, as in the two-pass code.
    block : int
        Keys per block.

    Returns
    -------
    output : (H, d) float32
    certificate_sq : (H,) or None
        ``C^2`` per query head.
    layer_certificate_sq : scalar tensor or None
        Output-space ``C^2`` summed over groups.
    """
    f32 = torch.float32
    q = group_queries(query, key.shape[0]).to(f32) * scaling
    n_kv, G, d = q.shape
    H, T = n_kv * G, key.shape[1]
    dev = key.device
    certified = weight is not None
    want_layer = certified and gram is not None
    if want_layer and quad is None:
        raise ValueError("the output-space certificate needs quad (pair_quadratic_forms)")
    first, second = pairs(G)
    n_pair = first.numel() if want_layer else G  # the G diagonal pairs come first
    off_first, off_second = first[G:n_pair].to(dev), second[G:n_pair].to(dev)
    first, second = first[:n_pair].to(dev), second[:n_pair].to(dev)
    # Rows of the shared product: p (G), pair rows w p_h p_h' (n_pair), fixed-size w p (G).
    fixed_at = G + n_pair
    n_rows = G + (n_pair + (G if fixed_size else 0) if certified else 0)
    m = torch.full((n_kv, G), float("-inf"), dtype=f32, device=dev)
    acc = torch.zeros(n_kv, n_rows, d, dtype=f32, device=dev)  # numerators
    sums = torch.zeros(n_kv, n_rows, dtype=f32, device=dev)  # sum of each row's weights
    acc_vsq = torch.zeros(n_kv, G, 1, dtype=f32, device=dev)  # diagonal rows times ||v||^2
    acc_quad = torch.zeros(n_kv, n_pair, dtype=f32, device=dev)  # pair rows times q_hh'
    for a in range(0, T, block):
        b = min(T, a + block)
        kb, vb = key[:, a:b].to(f32), value[:, a:b].to(f32)
        s = torch.baddbmm(bias[:, None, a:b].to(f32).expand(n_kv, G, b - a), q,
                          kb.transpose(1, 2))
        # The block's probabilities come from softmax (fused; aten's exp takes a slow path on
        # -inf and on results below float32's normal range), each row scaled afterwards by
        # c = l_b exp(m_b - m'), so that a * c = exp(s - m'), the online-softmax weights.
        m_block = s.amax(-1)
        m_new = torch.maximum(m, m_block)
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - safe)  # (H_kv, G); 0 while nothing was seen
        R = torch.empty(n_kv, n_rows, b - a, dtype=f32, device=dev)
        p = torch.softmax(s, -1, out=R[:, :G])
        # Every key of the block masked for this row (a +inf logit is not masked: it makes
        # the output NaN, as the two-pass code does).
        dead = torch.isneginf(m_block)
        if bool(dead.any()):
            p.masked_fill_(dead[..., None], 0.0)
        inv_l = p.amax(-1)  # softmax at the block's maximum is 1 / l_b
        live = (~dead).to(f32)
        c = torch.where(dead, torch.zeros_like(m_block),
                        torch.exp(m_block.masked_fill(dead, 0.0) - safe) / inv_l.clamp_min(
                            torch.finfo(f32).tiny))
        if certified:
            w = weight[:, None, a:b].to(f32)
            pp = torch.mul(p, p, out=R[:, G:2 * G])
            if want_layer:
                torch.mul(p[:, off_first], p[:, off_second], out=R[:, 2 * G:fixed_at])
                R[:, G:fixed_at].mul_(w)
            else:
                pp.mul_(w)
            if fixed_size:
                torch.mul(p, w, out=R[:, fixed_at:])
            alpha2 = alpha[:, first] * alpha[:, second]
            c2 = c[:, first] * c[:, second]
            scale_rows = torch.cat([alpha, alpha2, alpha] if fixed_size else [alpha, alpha2], 1)
            new_rows = torch.cat([c, c2, c] if fixed_size else [c, c2], 1)
            vsq = value_sq[:, a:b].to(f32) if value_sq is not None else (vb * vb).sum(-1)
            # One product gives every certificate row's sum and the diagonal rows' sums
            # times ||v||^2 (a softmax row sums to 1, so the G rows of p need no pass).
            ones_vsq = torch.stack([torch.ones_like(vsq), vsq], -1)  # (H_kv, B, 2)
            cert_sums = torch.bmm(R[:, G:], ones_vsq)  # (H_kv, n_rows - G, 2)
            acc_vsq = acc_vsq * alpha2[:, :G, None] + cert_sums[:, :G, 1:] * c2[:, :G, None]
            row_sums = torch.cat([live, cert_sums[..., 0]], 1)
            if want_layer:
                acc_quad = (acc_quad * alpha2
                            + (R[:, G:fixed_at] * quad[:, :, a:b].to(f32)).sum(-1) * c2)
        else:
            scale_rows, new_rows, row_sums = alpha, c, live
        acc = acc * scale_rows[..., None] + torch.bmm(R, vb) * new_rows[..., None]
        sums = sums * scale_rows + row_sums * new_rows
        m = m_new
    l = sums[:, :G]
    out = acc[:, :G] / l[..., None]  # (H_kv, G, d)
    if not certified:
        return out.reshape(H, d), None, None
    acc_vsq = acc_vsq[..., 0]
    # Primary certificate from the diagonal pairs: (S2 - 2 o.S1 + |o|^2 S0) / l^2.
    s0, s1 = sums[:, G:2 * G], acc[:, G:2 * G]
    cert = ((acc_vsq - 2 * (out * s1).sum(-1) + (out * out).sum(-1) * s0) / (l * l)).clamp_min(0)
    if fixed_size:
        # Rosén: m/(m-1) [sum w |z|^2 - |sum w z|^2 / sum w], z_i = a_i (v_i - o).
        sw = weight.to(f32).sum(-1)  # (H_kv,)
        swz = (acc[:, G + n_pair:] - out * sums[:, G + n_pair:, None]) / l[..., None]
        centred = cert - (swz * swz).sum(-1) / sw.clamp_min(1e-30)[:, None]
        cert = (fixed_size_inflation(weight, f32)[:, None] * centred).clamp_min(0)
    layer = None
    if want_layer:
        layer = _layer_certificate(out, acc[:, G:G + n_pair], sums[:, G:G + n_pair],
                                   acc_quad, l, gram, first, second)
    return out.reshape(H, d), cert.reshape(H), layer


def _layer_certificate(out, s1, s0, t1, l, gram, first, second):
    """``sum_g sum_{h,h'} [T1 - o_h^T Gam S1 - S1^T Gam o_h' + o_h^T Gam o_h' S0] / (l_h l_h')``
    over ordered pairs, from the unordered pair sums (off-diagonal pairs count twice)."""
    n_kv, G, d = out.shape
    blocks = gram.float().reshape(n_kv, G, d, G, d).permute(0, 1, 3, 2, 4)  # (H_kv,G,G,d,d)
    gam = blocks[:, first, second]  # (H_kv, n_pair, d, d)
    o_h, o_k = out[:, first], out[:, second]  # (H_kv, n_pair, d)
    go_k = torch.einsum("kpij,kpj->kpi", gam, o_k)  # Gam o_h'
    gto_h = torch.einsum("kpij,kpi->kpj", gam, o_h)  # Gam^T o_h
    term = (t1 - (gto_h * s1).sum(-1) - (go_k * s1).sum(-1) + (o_h * go_k).sum(-1) * s0)
    term = term / (l[:, first] * l[:, second])
    mult = torch.where(first == second, 1.0, 2.0).to(term)
    return (term * mult).sum()
