"""The MLA graft's math for one layer, as pure functions of weights and calibration statistics.

Original GQA layer (rotate-half RoPE, head dim d, K kv heads, H query heads, group g(i) = i // (H/K)):
  q_i = RoPE(W_q,i x),  k_j = RoPE(W_k,j x),  v_j = W_v,j x,  logit_i = q_i . k_g(i) / sqrt(d).

1. RoPE decoupling. For a frequency f, the pair components k_{j,f} of the K heads rotate by the same
   angle, so any orthogonal K x K mix U_f across heads commutes with RoPE ("RoRoPE"). With
   k'_{m,f} = sum_j U_f[m, j] k_{j,f}:  q_{i,f} . k_{g,f} = sum_m U_f[m, g] q_{i,f} . k'_{m,f}.
   U_f is the PCA of the heads' frequency-f key components (energy packs into m = 0). The kept set P
   of (m, f) pairs becomes the shared RoPE key (d_rope = 2|P| values); each query head's RoPE part
   carries the coefficient U_f[m, g(i)]. What is not kept, the residual key of group g at frequency f,
   k~_{g,f} = k_{g,f} - sum_{(m,f) in P} U_f[m, g] k'_{m,f}, loses RoPE and joins the latent.
2. Joint K/V latent. The no-RoPE targets y = [k~ ; v] (2Kd values, linear in x) are factorised as
   y ~ M^-1 U U^T M W_y x: latent c = U^T M W_y x (d_c values), up-projection M^-1 U. U holds the top
   d_c eigenvectors of M W_y C W_y^T M^T, C = E[x x^T] on calibration text (C = I: weights only).
   M balances K against V energy, and for the attention-aware objective also weights key errors by
   the queries' second moments (what the logits see) and value errors by W_O^T W_O (what the
   residual stream sees).
3. The softmax scale 1/sqrt(d) becomes 1/sqrt(d + d_rope): the ratio is folded into the queries.

Everything is exact when P holds every (m, f) and d_c >= rank of the targets (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from kvgraft.errors import ConfigError

Tensor = torch.Tensor


@dataclass
class GQAWeights:
    """One attention layer's weights in fp32/fp64 (biases may be None)."""

    q: Tensor  # (H*d, h)
    k: Tensor  # (K*d, h)
    v: Tensor  # (K*d, h)
    o: Tensor  # (h, H*d)
    q_bias: Tensor | None = None
    k_bias: Tensor | None = None
    v_bias: Tensor | None = None
    o_bias: Tensor | None = None


@dataclass
class MLAWeights:
    q_proj: Tensor  # (H*(dn+dr), h); with q_mix: the original (H*d, h)
    kv_a_proj: Tensor  # (dc+dr, h)
    kv_b_proj: Tensor  # (H*(dn+dv), dc)
    o_proj: Tensor  # (h, H*dv)
    rope_freq_index: tuple[int, ...]
    q_bias: Tensor | None = None
    kv_a_bias: Tensor | None = None
    kv_b_bias: Tensor | None = None
    o_bias: Tensor | None = None
    q_mix: Tensor | None = None  # (H, dn+dr, d): per-head map after q_norm (Qwen3-style models)
    q_norm: Tensor | None = None  # (d,)
    kv_a_norm: Tensor | None = None  # (dc,): the latent RMSNorm's weight (DeepSeek's kv_a_layernorm), when grafted with one


def _pair_rows(head: int, f: int, d: int) -> list[int]:
    """Rows of a (heads*d, h) projection holding frequency f of ``head`` (rotate-half layout)."""
    return [head * d + f, head * d + f + d // 2]


def head_rotations(
    w_k: Tensor, C: Tensor, num_kv_heads: int, d: int, w_kC: Tensor | None = None, rotation: str = "real"
) -> Tensor:
    """(d/2, K, K) orthogonal U_f, rows sorted by decreasing key energy at frequency f.

    Energy of a head combination u at frequency f: sum over the pair's two coordinates of
    E[(u . k_f)^2] = u^T G_f u with G_f[j, j'] = sum_c W_{j,f,c} C W_{j',f,c}^T.
    ``w_kC``: ``w_k @ C`` when the caller has it (one h x h product per layer instead of one per frequency).

    ``rotation="complex"``: unitary U_f (complex128). A frequency-f pair is a complex number z_j = k_{j,f} +
    i k_{j,f+d/2} that RoPE multiplies by e^{i delta theta_f}, so complex mixes z'_m = sum_j U_f[m, j] z_j commute
    with it too; U_f holds the eigenvectors (conjugated) of the Hermitian G_f[j, j'] = E[z_j conj(z_j')], whose
    real part is the real G_f. The principal z'_0 is then the best rank-1 complex approximation of the K heads'
    pair (z_g ~ conj(U_f[0, g]) z'_0): a per-head phase as well as a weight, which the queries take
    (q_{i,f} -> U_f[0, g(i)] q_{i,f}). It keeps at least the real one's energy. Each row's largest entry is made
    real and positive (one KV head: U_f = 1, the real rotation).
    """
    if rotation not in ROPE_ROTATIONS:
        raise ConfigError(f"rotation {rotation!r} is not one of {', '.join(ROPE_ROTATIONS)}")
    K = num_kv_heads
    if w_kC is None:
        w_kC = w_k @ C
    cplx = rotation == "complex"
    U = torch.empty(d // 2, K, K, dtype=torch.complex128 if cplx else w_k.dtype, device=w_k.device)
    for f in range(d // 2):
        first = [j * d + f for j in range(K)]
        second = [j * d + f + d // 2 for j in range(K)]
        G = w_kC[first] @ w_k[first].T + w_kC[second] @ w_k[second].T  # (K, K)
        G = (G + G.T) / 2
        if cplx:
            Gi = w_kC[second] @ w_k[first].T - w_kC[first] @ w_k[second].T  # Im E[z_j conj(z_j')]
            G = torch.complex(G.to(torch.float64), ((Gi - Gi.T) / 2).to(torch.float64))
        evals, evecs = torch.linalg.eigh(G)
        rows = evecs[:, evals.argsort(descending=True)].mH  # u_m = v_m^H maximises E|u z|^2
        if cplx:
            phase = torch.gather(rows, 1, rows.abs().argmax(dim=1, keepdim=True))  # (K, 1)
            mag = phase.abs()
            rows = rows * torch.where(mag > 0, phase.conj() / mag.clamp_min(1e-300), torch.ones_like(phase))
        U[f] = rows
    return U


ROPE_ROTATIONS = ("real", "complex")


def _mix(u: Tensor, first: Tensor, second: Tensor) -> tuple[Tensor, Tensor]:
    """The pair (first + i second) times the complex (or real) coefficient(s) ``u``, summed over a leading head
    axis when ``u`` is a vector: (Re, Im) as real tensors."""
    if u.is_complex():
        ur, ui = u.real, u.imag
    else:
        ur, ui = u, torch.zeros_like(u)
    if u.dim() == 0:
        return ur * first - ui * second, ui * first + ur * second
    return (
        torch.einsum("j,j...->...", ur, first) - torch.einsum("j,j...->...", ui, second),
        torch.einsum("j,j...->...", ui, first) + torch.einsum("j,j...->...", ur, second),
    )


def pair_scores(
    w: GQAWeights,
    C: Tensor,
    U: Tensor,
    num_heads: int,
    num_kv_heads: int,
    d: int,
    rope_expectation: Tensor | None = None,
    w_qC: Tensor | None = None,
    w_kC: Tensor | None = None,
) -> Tensor:
    """(K, d/2) contribution of each rotated (m, f) pair: sqrt E|q'|^2 * sqrt E|k'|^2 summed over heads.

    The 2-norm criterion of MHA2MLA, applied after the head rotation. With ``rope_expectation`` each
    frequency is weighted by what replacing its rotation R by E[R] loses, sqrt(1 - c^2 - s^2)
    (E||R - E[R]||_F^2 = 2 (1 - c^2 - s^2)): slow frequencies barely rotate over the distances
    attention uses, so they can give up RoPE cheaply. ``w_qC``/``w_kC``: ``w.q @ C``/``w.k @ C`` when the
    caller has them.
    """
    K, H = num_kv_heads, num_heads
    group, half = H // K, d // 2

    def pair_norms(rows: Tensor, rowsC: Tensor) -> Tensor:  # (heads*d, h) -> (heads, d/2): sqrt E|pair|^2
        energy = (rowsC * rows).sum(-1).clamp_min(0).view(-1, d)
        return (energy[:, :half] + energy[:, half:]).sqrt()

    if w_qC is None:
        w_qC = w.q @ C
    if w_kC is None:
        w_kC = w.k @ C
    q_norms = pair_norms(w.q, w_qC)  # (H, d/2)

    def rotate(rows: Tensor) -> Tensor:  # rows of the rotated heads, (K*d, h); (K, coordinate, f, h) layout
        r = rows.reshape(K, 2, half, -1)
        if U.is_complex():  # (u z): Re = ur a - ui b, Im = ui a + ur b
            ur, ui = U.real.to(rows.dtype), U.imag.to(rows.dtype)
            re = torch.einsum("fmj,jfh->mfh", ur, r[:, 0]) - torch.einsum("fmj,jfh->mfh", ui, r[:, 1])
            im = torch.einsum("fmj,jfh->mfh", ui, r[:, 0]) + torch.einsum("fmj,jfh->mfh", ur, r[:, 1])
            return torch.stack([re, im], dim=1).reshape(K * d, -1)
        return torch.einsum("fmj,jcfh->mcfh", U, r).reshape(K * d, -1)

    k_norms = pair_norms(rotate(w.k), rotate(w_kC))  # (K, d/2): energy of rotated head m at frequency f
    # |U_f[m, g(i)]| * |q_i,f| summed over the query heads i, per (m, f)
    coef = U.abs().to(q_norms.dtype)[:, :, torch.arange(H, device=U.device) // group]  # (d/2, K, H)
    score = torch.einsum("fmi,if->mf", coef, q_norms) * k_norms
    if rope_expectation is not None:
        spread = (1 - rope_expectation.to(device=score.device, dtype=score.dtype).pow(2).sum(-1)).clamp_min(0).sqrt()  # (d/2,)
        score = score * spread[None, :]
    return score


def choose_rope_pairs(kind: str, d_rope: int, num_kv_heads: int, d: int, scores: Tensor | None) -> list[tuple[int, int]]:
    """The kept (m, f) pairs, ordered as the RoPE key's pairs.

    "stride": the principal rotated head at every (d/d_rope)-th frequency -- DeepSeek's own frequency
    layout, so the result exports to stock DeepSeek-V3 (d_rope <= d). "prefix": the principal rotated head at
    the d_rope/2 fastest frequencies (stock DeepSeek-V3 with rope_theta^(d_rope/d)). "norm": the d_rope/2 pairs with
    the largest measured contribution, from any rotated head (kvgraft format).
    """
    n = d_rope // 2
    if kind == "stride":
        if d_rope > d or d % d_rope:
            raise ConfigError(f"rope selection 'stride' needs d_rope ({d_rope}) to divide head_dim ({d})")
        return [(0, f) for f in range(0, d // 2, d // d_rope)]
    if kind == "prefix":
        # the principal rotated head at the d_rope/2 fastest frequencies: pair j rotates at theta^(-2j/d), which
        # stock DeepSeek-V3 computes as theta'^(-2j/d_rope) with rope_theta' = theta^(d_rope/d) (default RoPE)
        if d_rope > d:
            raise ConfigError(f"rope selection 'prefix' needs d_rope ({d_rope}) <= head_dim ({d})")
        return [(0, f) for f in range(n)]
    if kind == "norm":
        if scores is None:
            raise ConfigError("rope selection 'norm' needs pair scores")
        if n > num_kv_heads * d // 2:
            raise ConfigError(f"d_rope ({d_rope}) exceeds the model's total RoPE width ({num_kv_heads * d})")
        flat = scores.flatten().argsort(descending=True)[:n]
        pairs = [(int(i) // (d // 2), int(i) % (d // 2)) for i in flat]
        return sorted(pairs, key=lambda p: (p[1], p[0]))
    raise ConfigError(f"unknown rope selection {kind!r}; expected 'stride', 'prefix' or 'norm'")


def shared_rope_pairs(scores: list[Tensor], d_rope: int) -> list[list[tuple[int, int]]]:
    """One frequency layout for every layer ("shared" selection), from each layer's (K, d/2) pair scores.

    A slot (f, r) is "the r-th strongest rotated head at frequency f"; its value is the sum over layers of
    that head's score, each layer's scores normalised to sum to one (every layer weighs the same). The
    d_rope/2 best slots are kept (prefix-closed per frequency, since a layer's r-th score never exceeds its
    (r-1)-th); each layer then keeps, per chosen slot, its own r-th strongest head at f. So all layers rotate
    the same frequencies (what shared RoPE keys need) while each keeps its own strongest heads.
    """
    n = d_rope // 2
    ranked = [torch.sort(sc / sc.sum().clamp_min(1e-30), dim=0, descending=True) for sc in scores]
    K, half = scores[0].shape
    if n > K * half:
        raise ConfigError(f"d_rope ({d_rope}) exceeds the model's total RoPE width ({2 * K * half})")
    value = cast(Tensor, sum(r.values for r in ranked))  # (K ranks, d/2)
    flat = value.flatten().argsort(descending=True)[:n]
    slots = sorted((int(i) % half, int(i) // half) for i in flat)  # (f, rank), by frequency then rank
    return [[(int(r.indices[rank, f]), f) for f, rank in slots] for r in ranked]


def _sqrtm_psd(A: Tensor, ridge: float = 1e-6) -> tuple[Tensor, Tensor]:
    """(A^1/2, A^-1/2) of a symmetric PSD matrix, with a relative ridge for invertibility."""
    evals, evecs = torch.linalg.eigh(A)
    evals = evals.clamp_min(0) + ridge * evals.abs().max().clamp_min(1e-30)
    return (evecs * evals.sqrt()) @ evecs.T, (evecs * evals.rsqrt()) @ evecs.T


@dataclass(frozen=True)
class LayerSpec:
    """What ``convert_layer`` makes of one layer: its sizes (``num_heads`` query heads, ``num_kv_heads`` KV
    heads of width ``head_dim``), the ranks (``kv_lora_rank`` = d_c, ``d_rope``) and how the factorisation runs.

    ``objective``: "weights" | "activations" | "attention" (see the module docstring). ``rope_selection``: how
    the kept RoPE pairs are chosen when the caller gives none (``choose_rope_pairs``). ``balance_kv``: weigh
    key against value energy in the joint latent. ``rope_attention_scaling``: the factor RoPE multiplies
    cos/sin by (YaRN's attention factor); the original logits carry its square on every dimension, the
    no-RoPE part must get it through q. ``rope_rotation``: "real" (orthogonal head mixes per frequency) or
    "complex" (unitary: the kept rotated head is the best rank-1 complex fit of the KV heads' pair, see
    ``head_rotations``)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int
    d_rope: int
    objective: str = "activations"
    rope_selection: str = "stride"
    balance_kv: bool = True
    rope_attention_scaling: float = 1.0
    rope_rotation: str = "real"


def convert_layer(
    w: GQAWeights,
    spec: LayerSpec,
    C: Tensor | None,
    *,
    q_norm_weight: Tensor | None = None,
    rope_expectation: Tensor | None = None,
    pairs: list[tuple[int, int]] | None = None,
    device: str | torch.device | None = None,
) -> MLAWeights:
    """Convert one GQA layer to MLA (kvgraft layout: d_nope = d_v = head_dim) as ``spec`` says.

    ``pairs``: the kept (rotated head, frequency) pairs, chosen by the caller (the "shared" selection);
    None: chosen here by ``rope_selection``.

    ``q_norm_weight``: the per-head query RMSNorm of Qwen3-style models. Queries then stay in their
    original basis (q_proj unchanged, q_norm kept) and the MLA query is a per-head map ``q_mix`` of the
    normalised head. (Their key RMSNorm must already be linearised into ``w.k`` by the caller.)
    ``rope_expectation`` (d/2, 2): per frequency, E[cos] and E[sin] of the relative rotation under the
    layer's attention-distance profile. A pair that loses RoPE contributes q^T R(-delta theta) k to the
    logit; replacing R by its expectation M_f (instead of the identity) is the best fixed stand-in, and
    it folds into the no-RoPE query as M_f^T q. None: the identity (plain dropping).

    ``C``: E[x x^T] of the layer's attention input on calibration text, or None for weights only.
    ``device``: where the fp64 math runs (default: the weights' device); the returned weights live there.
    """
    objective, rope_selection, kv_lora_rank = spec.objective, spec.rope_selection, spec.kv_lora_rank
    sh = _Shape(
        spec.num_heads, spec.num_kv_heads, spec.head_dim, w.q.shape[1], w.q.device if device is None else torch.device(device)
    )
    w = _on(w, sh.dev)  # where the fp64 math runs (CPU or a GPU)
    if rope_expectation is not None:
        rope_expectation = rope_expectation.to(device=sh.dev, dtype=torch.float64)
    if q_norm_weight is not None:
        q_norm_weight = q_norm_weight.to(sh.dev)
    C, identity_C = _second_moment(C, objective, sh)

    # The h x h products with C, once per layer (the dominant cost at real widths: O(rows x h^2) each)
    def times_C(W: Tensor) -> Tensor:
        return W.clone() if identity_C else W @ C

    need_q = objective == "attention" or (pairs is None and rope_selection == "norm")
    w_qC = times_C(w.q) if need_q else None
    w_kC, w_vC = times_C(w.k), times_C(w.v)

    # ---- 1. RoPE decoupling ------------------------------------------------------------------
    U = head_rotations(w.k, C, sh.K, sh.d, w_kC, rotation=spec.rope_rotation)  # (d/2, K, K), complex128 if "complex"
    if pairs is None:
        scores = (
            pair_scores(w, C, U, sh.H, sh.K, sh.d, rope_expectation, w_qC=w_qC, w_kC=w_kC) if rope_selection == "norm" else None
        )
        pairs = choose_rope_pairs(rope_selection, spec.d_rope, sh.K, sh.d, scores)
    rope = _decouple_rope(w, w_kC, U, pairs, sh)
    # ---- 2. joint K/V latent -----------------------------------------------------------------
    A, B, b_y = _joint_latent(w, rope, w_qC, w_vC, objective, spec.balance_kv, kv_lora_rank, sh)
    # ---- 3. assemble MLA weights (per query head; GQA groups replicated) -----------------------
    q_proj, q_bias, q_mix = _queries(w, U, pairs, spec.rope_attention_scaling, rope_expectation, q_norm_weight, sh)
    kv_a, kv_a_bias, kv_b, kv_b_bias = _latent_projections(w, rope, A, B, b_y, kv_lora_rank, sh)
    return MLAWeights(
        q_proj=q_proj,
        kv_a_proj=kv_a,
        kv_b_proj=kv_b,
        o_proj=w.o,
        rope_freq_index=tuple(f for _, f in pairs),
        q_bias=q_bias,
        kv_a_bias=kv_a_bias,
        kv_b_bias=kv_b_bias,
        o_bias=w.o_bias,
        q_mix=q_mix,
        q_norm=q_norm_weight,
    )


@dataclass(frozen=True)
class _Shape:
    """One layer's sizes and where its fp64 math runs: H query heads, K KV heads of width d, hidden size h."""

    H: int
    K: int
    d: int
    h: int
    dev: torch.device

    @property
    def group(self) -> int:
        return self.H // self.K


def _on(w: GQAWeights, dev: torch.device) -> GQAWeights:
    """``w`` in float64 on ``dev``."""

    def on_dev_or_none(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(device=dev, dtype=torch.float64)

    q, k, v, o = (t.to(device=dev, dtype=torch.float64) for t in (w.q, w.k, w.v, w.o))
    return GQAWeights(q, k, v, o, *(on_dev_or_none(b) for b in (w.q_bias, w.k_bias, w.v_bias, w.o_bias)))


def _second_moment(C: Tensor | None, objective: str, sh: _Shape) -> tuple[Tensor, bool]:
    """The layer input's E[x x^T] in float64 on the math device (the identity for objective "weights"), and
    whether it is that identity."""
    if objective not in ("weights", "activations", "attention"):
        raise ConfigError(f"unknown objective {objective!r}; expected weights, activations or attention")
    if objective == "weights" or C is None:
        if objective != "weights":
            raise ConfigError(f"objective {objective!r} needs calibration statistics")
        C = torch.eye(sh.h, dtype=torch.float64, device=sh.dev)
    return C.to(device=sh.dev, dtype=torch.float64), objective == "weights"


@dataclass
class _RopeSplit:
    """Step 1's result: the shared RoPE key rows (2n, h) of the kept pairs (rotate-half: pair j -> rows j and
    j + n) and the residual no-RoPE keys per group (K d, h), with ``k_resC`` = k_res @ C and the biases."""

    n: int
    k_rope: Tensor
    k_rope_b: Tensor | None
    k_res: Tensor
    k_resC: Tensor
    k_res_b: Tensor | None


def _decouple_rope(w: GQAWeights, w_kC: Tensor, U: Tensor, pairs: list[tuple[int, int]], sh: _Shape) -> _RopeSplit:
    """Step 1, RoPE decoupling: the kept (rotated head, frequency) pairs' key rows, and what remains of each
    group's keys once they are taken out."""
    K, d, dtype, dev = sh.K, sh.d, torch.float64, sh.dev
    n = len(pairs)

    # shared RoPE key rows: pair j -> rows j and j + n (rotate-half over d_rope)
    def rotated_k_rows(m: int, f: int, wk: Tensor) -> Tensor:  # (2, ...) rows of k'_{m,f}
        P = torch.stack([wk[_pair_rows(j, f, d)] for j in range(K)])  # (K, 2, ...)
        return torch.stack(_mix(U[f][m], P[:, 0], P[:, 1]))

    def back(m: int, f: int, g: int, rows: Tensor) -> Tensor:  # (2, ...): group g's part of k'_{m,f}, conj(U) k'
        return torch.stack(_mix(U[f][m, g].conj(), rows[0], rows[1]))

    k_rope = torch.empty(2 * n, sh.h, dtype=dtype, device=dev)
    k_rope_b = torch.zeros(2 * n, dtype=dtype, device=dev) if w.k_bias is not None else None
    for j, (m, f) in enumerate(pairs):
        rows = rotated_k_rows(m, f, w.k)
        k_rope[j], k_rope[j + n] = rows[0], rows[1]
        if k_rope_b is not None and w.k_bias is not None:  # (both or neither)
            b = rotated_k_rows(m, f, w.k_bias[:, None])[:, 0]
            k_rope_b[j], k_rope_b[j + n] = b[0], b[1]
    # residual (no-RoPE) keys per group: k - sum_{kept} U_f[m, g] k'_{m,f}
    k_res = w.k.clone()
    k_resC = w_kC.clone()  # k_res @ C, by the same row operations
    k_res_b = None if w.k_bias is None else w.k_bias.clone()
    for m, f in pairs:
        rows = rotated_k_rows(m, f, w.k)
        rowsC = rotated_k_rows(m, f, w_kC)
        brow = None if w.k_bias is None else rotated_k_rows(m, f, w.k_bias[:, None])[:, 0]
        for g in range(K):
            k_res[_pair_rows(g, f, d)] -= back(m, f, g, rows)
            k_resC[_pair_rows(g, f, d)] -= back(m, f, g, rowsC)
            if k_res_b is not None and brow is not None:  # (both or neither)
                k_res_b[_pair_rows(g, f, d)] -= back(m, f, g, brow)
    return _RopeSplit(n, k_rope, k_rope_b, k_res, k_resC, k_res_b)


def _joint_latent(
    w: GQAWeights,
    rope: _RopeSplit,
    w_qC: Tensor | None,
    w_vC: Tensor,
    objective: str,
    balance_kv: bool,
    kv_lora_rank: int,
    sh: _Shape,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Step 2, the joint K/V latent of [k_res; v]: (A (d_c, h) the down-projection, B (2Kd, d_c) the
    up-projection back, the bias of [k_res; v] or None)."""
    K, d, h, group, dtype, dev = sh.K, sh.d, sh.h, sh.group, torch.float64, sh.dev
    W_y = torch.cat([rope.k_res, w.v])  # (2Kd, h)
    b_y = None
    if w.k_bias is not None or w.v_bias is not None:
        zeros = torch.zeros(K * d, dtype=dtype, device=dev)
        b_y = torch.cat([rope.k_res_b if rope.k_res_b is not None else zeros, w.v_bias if w.v_bias is not None else zeros])
    M = torch.eye(2 * K * d, dtype=dtype, device=dev)
    M_inv = torch.eye(2 * K * d, dtype=dtype, device=dev)
    if objective == "attention":
        assert w_qC is not None  # need_q
        for g in range(K):
            grows = slice(g * d, (g + 1) * d)
            # keys: logit error q^T (k - k_hat) summed over the group's query heads
            Wq = w.q[group * g * d : (group * g + group) * d].view(group, d, h)
            WqC = w_qC[group * g * d : (group * g + group) * d].view(group, d, h)
            Sq = cast(Tensor, sum(WqC[i] @ Wq[i].T for i in range(group)))
            Sq = (Sq + Sq.T) / 2
            s, s_inv = _sqrtm_psd(Sq)
            M[grows, grows], M_inv[grows, grows] = s, s_inv
            # values: output error W_O,i (v - v_hat) summed over the group's heads
            Wo = w.o[:, group * g * d : (group * g + group) * d].view(h, group, d)
            So = cast(Tensor, sum(Wo[:, i].T @ Wo[:, i] for i in range(group)))
            s, s_inv = _sqrtm_psd(So)
            vr = slice(K * d + g * d, K * d + (g + 1) * d)
            M[vr, vr], M_inv[vr, vr] = s, s_inv
    G = torch.cat([rope.k_resC, w_vC]) @ W_y.T  # W_y C W_y^T, (2Kd, 2Kd)
    S = M @ ((G + G.T) / 2) @ M.T
    if balance_kv:
        e_k, e_v = torch.diagonal(S)[: K * d].sum(), torch.diagonal(S)[K * d :].sum()
        if e_k > 0 and e_v > 0:
            alpha = (e_v / e_k).sqrt()
            M[: K * d] *= alpha
            M_inv[:, : K * d] /= alpha
            D = torch.ones(2 * K * d, dtype=dtype, device=dev)
            D[: K * d] = alpha
            S = S * D[:, None] * D[None, :]  # = (D M) W_y C W_y^T (D M)^T
    evals, evecs = torch.linalg.eigh((S + S.T) / 2)
    top = evecs[:, evals.argsort(descending=True)[:kv_lora_rank]]  # (2Kd, dc)
    A = top.T @ M @ W_y  # (dc, h): the latent down-projection
    B = M_inv @ top  # (2Kd, dc): up-projection back to [k_res; v]
    return A, B, b_y


def _queries(
    w: GQAWeights,
    U: Tensor,
    pairs: list[tuple[int, int]],
    rope_attention_scaling: float,
    rope_expectation: Tensor | None,
    q_norm_weight: Tensor | None,
    sh: _Shape,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Step 3, the queries: (q_proj, its bias, q_mix) per query head, [no-RoPE d | RoPE 2n] each; with a
    query norm, q_proj stays the original and q_mix maps the normalised head."""
    H, d, h, group, dtype, dev = sh.H, sh.d, sh.h, sh.group, torch.float64, sh.dev
    n = len(pairs)
    scale = ((d + 2 * n) / d) ** 0.5  # new softmax scale 1/sqrt(d + d_rope) -> fold the ratio into q
    nope_scale = scale * rope_attention_scaling**2  # no-RoPE dims lose RoPE's cos/sin factor
    nope_map = torch.eye(d, dtype=dtype, device=dev)  # (d, d) applied to each head's query before the no-RoPE dot
    if rope_expectation is not None:
        # pair (f, f + d/2) <- M_f^T (q_f, q_{f+d/2}),  M_f^T = [[c, -s], [s, c]]
        half = d // 2
        c, s_ = rope_expectation[:, 0].to(dtype), rope_expectation[:, 1].to(dtype)
        idx = torch.arange(half, device=dev)
        nope_map = torch.zeros(d, d, dtype=dtype, device=dev)
        nope_map[idx, idx], nope_map[idx, idx + half] = c, -s_
        nope_map[idx + half, idx], nope_map[idx + half, idx + half] = s_, c
    nope_map = nope_map * nope_scale
    q_nope = torch.einsum("ed,kdh->keh", nope_map, w.q.view(H, d, h))
    q_rope = torch.empty(H, 2 * n, h, dtype=dtype, device=dev)
    qb_nope = None if w.q_bias is None else w.q_bias.view(H, d) @ nope_map.T
    qb_rope = None if w.q_bias is None else torch.empty(H, 2 * n, dtype=dtype, device=dev)
    for i in range(H):
        g = i // group
        for j, (m, f) in enumerate(pairs):
            coef = U[f][m, g] * scale  # the query pair times U_f[m, g] (complex: a phase too)
            prow = _pair_rows(i, f, d)
            q_rope[i, j], q_rope[i, j + n] = _mix(coef, w.q[prow[0]], w.q[prow[1]])
            if qb_rope is not None and w.q_bias is not None:  # (both or neither)
                qb_rope[i, j], qb_rope[i, j + n] = _mix(coef, w.q_bias[prow[0]], w.q_bias[prow[1]])
    q_proj = torch.cat([q_nope, q_rope], dim=1).reshape(H * (d + 2 * n), h)
    q_bias = None if qb_nope is None or qb_rope is None else torch.cat([qb_nope, qb_rope], dim=1).reshape(-1)
    q_mix = None
    if q_norm_weight is not None:  # the same per-head linear map, applied after the query norm
        q_mix = torch.zeros(H, d + 2 * n, d, dtype=dtype, device=dev)
        q_mix[:, :d] = nope_map
        for i in range(H):
            for j, (m, f) in enumerate(pairs):
                coef = U[f][m, i // group] * scale
                cr, ci = (coef.real, coef.imag) if coef.is_complex() else (coef, 0.0)
                q_mix[i, d + j, f], q_mix[i, d + j, f + d // 2] = cr, -ci
                q_mix[i, d + n + j, f], q_mix[i, d + n + j, f + d // 2] = ci, cr
        q_proj, q_bias = w.q, w.q_bias
    return q_proj, q_bias, q_mix


def _latent_projections(
    w: GQAWeights, rope: _RopeSplit, A: Tensor, B: Tensor, b_y: Tensor | None, kv_lora_rank: int, sh: _Shape
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """Step 3, the latent projections: (kv_a [A; k_rope], its bias, kv_b per query head, its bias)."""
    K, d, dtype, dev = sh.K, sh.d, torch.float64, sh.dev
    B_k, B_v = B[: K * d].view(K, d, -1), B[K * d :].view(K, d, -1)
    heads = torch.arange(sh.H, device=dev) // sh.group
    kv_b = torch.cat([B_k[heads], B_v[heads]], dim=1).reshape(sh.H * 2 * d, kv_lora_rank)
    kv_b_bias = None
    if b_y is not None:
        bk, bv = b_y[: K * d].view(K, d), b_y[K * d :].view(K, d)
        kv_b_bias = torch.cat([bk[heads], bv[heads]], dim=1).reshape(-1)
    kv_a = torch.cat([A, rope.k_rope])
    kv_a_bias = None
    if rope.k_rope_b is not None:
        kv_a_bias = torch.cat([torch.zeros(kv_lora_rank, dtype=dtype, device=dev), rope.k_rope_b])
    elif w.q_bias is not None or w.v_bias is not None:
        kv_a_bias = torch.zeros(kv_lora_rank + 2 * rope.n, dtype=dtype, device=dev)
    return kv_a, kv_a_bias, kv_b, kv_b_bias
