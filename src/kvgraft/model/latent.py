"""Latent attention shared by MLA and the causal encoder-decoder: keys and values up-projected from a
cached latent by ``kv_b``, optionally next to a layer's own window keys, under one softmax.

Two equivalent paths (tested to agree):
- expanded: ``kv_b`` up-projects every latent to per-head keys ``[W_UK c ; k_r]`` and values ``W_UV c``,
  then ordinary attention (cheap for long prefills);
- absorbed: ``W_UK`` is folded into the query (``q_lat = W_UK^T q_nope``) and ``W_UV`` applied after the
  softmax, so the step attends over the latents directly (one key/value head of width d_c + d_rope):
  cheap for decode, nothing is expanded.

**Weights through one door.** Every path that reads a projection's matrix directly (absorbed decode,
folds) calls :func:`linear_weight`, which returns the weight a forward of the module would apply: a
module may define ``effective_weight() -> (weight, bias)`` (an adapter wrapper), and a PEFT LoRA layer's
active, unmerged deltas are added. So an adapter on q, kv_b or o is never bypassed at decode. Outside
autograd the merged PEFT weight is kept on the layer and reused while the base weight, the adapter's
factors, its scaling and the active adapters are unchanged (checked by identity and in-place version), so
a decode step never re-merges, and a fold keyed on the weight's identity (MLA's) stays valid.

**Absorbed decode is one batched matmul for the scores and one for the values, over all heads and rows**
(no loop over heads): the query heads sit side by side on the query axis against the one shared latent
head (G, 1, H T, d_c + d_rope) x (G, 1, d_c + d_rope, N); W_UK / W_UV are applied as batched matmuls over
the (small) per-head queries and outputs. The softmax scale multiplies the query, not the score matrix.
Shapes: G rows, H query heads, K window heads, T queries, S window keys, N latents.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvgraft.errors import ConfigError
from kvgraft.model.attention_ops import head_matmul, sdpa


def linear_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (out, in), bias (out,) or None) that ``module``'s forward applies, adapters included."""
    # duck typed: an adapter wrapper, a PEFT LoRA layer (untyped) or a plain linear
    layer: Any = module
    effective = getattr(layer, "effective_weight", None)
    if effective is not None:
        weight, bias = effective()
        return weight, bias
    base = getattr(layer, "base_layer", None)
    if base is not None and hasattr(layer, "get_delta_weight"):  # a PEFT LoRA layer
        weight, bias = linear_weight(base)
        if getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):
            return weight, bias
        names = [n for n in layer.active_adapters if n in layer.lora_A]
        if not names:
            return weight, bias
        if torch.is_grad_enabled():  # training: the merge must stay in the graph
            return _merge_peft(module, weight, names), bias
        key = _peft_key(module, weight, names)
        hit = getattr(layer, "_kvgraft_merged", None)
        if hit is not None and hit[0] == key and all(a is b for a, b in zip(hit[1], _peft_tensors(module, weight, names))):
            return hit[2], bias
        merged = _merge_peft(module, weight, names)
        # the tensors the key names are held, so no id in the key can be reused while the entry lives
        layer._kvgraft_merged = (key, _peft_tensors(module, weight, names), merged)
        return merged, bias
    return layer.weight, layer.bias


def _merge_peft(module: Any, weight: torch.Tensor, names: list[str]) -> torch.Tensor:
    for name in names:
        weight = weight + module.get_delta_weight(name).to(weight.dtype)
    return weight


def _peft_tensors(module: Any, weight: torch.Tensor, names: list[str]) -> list[torch.Tensor]:
    out = [weight]
    for name in names:
        out += [module.lora_A[name].weight, module.lora_B[name].weight]
    return out


def _version(t: torch.Tensor) -> tuple[int, int, torch.dtype, torch.device]:
    return id(t), -1 if t.is_inference() else t._version, t.dtype, t.device


def _peft_key(module: Any, weight: torch.Tensor, names: list[str]) -> tuple[object, ...]:
    scaling = getattr(module, "scaling", {})
    return (tuple(names), tuple(scaling.get(n) for n in names), tuple(_version(t) for t in _peft_tensors(module, weight, names)))


def per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(G, H, T, a) x (H, a, b) per head -> (G, H, T, b), with the rows folded into each head's matmul:
    ``torch.matmul`` would broadcast ``w`` over the G rows and copy it G times (a view of kv_b's rows)."""
    G, H, T, _ = x.shape
    y = torch.bmm(x.transpose(0, 1).reshape(H, G * T, -1), w)  # (H, G T, b)
    return y.view(H, G, T, -1).transpose(0, 1)


class LatentAttention(nn.Module):
    """Base of MLAttention and CEDAttention: owns ``kv_b_proj`` (d_c -> H (d_nope + d_v)) and the math
    of attending over latents. Subclasses set num_heads, dc, dr, dn, dv, scale and the projections."""

    num_heads: int
    dc: int
    dr: int
    dn: int
    dv: int
    scale: float

    def weights(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The one door to a projection's (weight, bias), e.g. ``weights("kv_b_proj")``."""
        return linear_weight(getattr(self, name))

    def split_kv_b(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """W_UK (H, dn, dc), W_UV (H, dv, dc), key bias (H, dn) or None, value bias (H, dv) or None."""
        w, b = self.weights("kv_b_proj")
        w = w.view(self.num_heads, self.dn + self.dv, self.dc)
        bk = bv = None
        if b is not None:
            b = b.view(self.num_heads, self.dn + self.dv)
            bk, bv = b[:, : self.dn], b[:, self.dn :]
        return w[:, : self.dn], w[:, self.dn :], bk, bv

    def attend(
        self,
        q: torch.Tensor,  # (G, H, T, dn + dr): no-RoPE then rotated RoPE part
        k: torch.Tensor | None,  # (G, K, S, dn + dr) window keys (own heads), or None
        v: torch.Tensor | None,  # (G, K, S, dv)
        latents: torch.Tensor | None,  # (G, N, >= dc + dr): latent then rotated RoPE key, or None
        mask: torch.Tensor,  # (G, T, S + N) bool, True = attend
        absorbed: bool,
        kv_b_delta: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """(G, H, T, dv): one softmax over [window keys ; latents]. ``kv_b_delta`` (absorbed only): per-row
        LoRA factors (A (G, r, dc), B (G, H (dn + dv), r), scale folded in) added to the door's kv_b, so
        rows of different adapters attend in one call (W_UK + B_k A and W_UV + B_v A, applied low-rank)."""
        if absorbed:
            return self._attend_absorbed(q, k, v, latents, mask, kv_b_delta)
        if kv_b_delta is not None:
            raise ConfigError("kv_b_delta is for the absorbed path")
        return self._attend_expanded(q, k, v, latents, mask)

    def _attend_expanded(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, latents: torch.Tensor | None, mask: torch.Tensor
    ) -> torch.Tensor:
        G, H, T, _ = q.shape
        keys, values = [], []
        if k is not None and v is not None:
            rep = H // k.shape[1]
            keys.append(k.repeat_interleave(rep, dim=1))
            values.append(v.repeat_interleave(rep, dim=1))
        if latents is not None:
            N = latents.shape[1]
            c, k_rope = latents[..., : self.dc], latents[..., self.dc : self.dc + self.dr]
            w, b = self.weights("kv_b_proj")
            kv = F.linear(c, w, b).view(G, N, H, self.dn + self.dv).transpose(1, 2)  # (G, H, N, dn + dv)
            keys.append(torch.cat([kv[..., : self.dn], k_rope[:, None].expand(G, H, N, self.dr)], dim=-1))
            values.append(kv[..., self.dn :])
        k_all = keys[0] if len(keys) == 1 else torch.cat(keys, dim=2)
        v_all = values[0] if len(values) == 1 else torch.cat(values, dim=2)
        return sdpa(q, k_all, v_all, attn_mask=mask[:, None], scale=self.scale)  # (the CPU's fused kernel)

    def _attend_absorbed(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        latents: torch.Tensor | None,
        mask: torch.Tensor,
        kv_b_delta: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Scores against the latents directly (W_UK folded into the query, W_UV applied after), next to
        the window scores under one softmax. Window heads are read per group (the query heads of a group
        side by side on the query axis), not repeated."""
        G, H, T, _ = q.shape
        q, q_lat, lat_bias = self.absorbed_queries(q, latents is not None, kv_b_delta)
        parts = []
        if k is not None and v is not None:
            K, S = k.shape[1], k.shape[2]
            parts.append(head_matmul(q.reshape(G, K, H // K * T, -1), k.transpose(-1, -2)).view(G, H, T, S))
        if latents is not None and q_lat is not None:
            entry = latents[:, None, :, : self.dc + self.dr]
            s_lat = torch.matmul(q_lat.reshape(G, 1, H * T, -1), entry.transpose(-1, -2)).view(G, H, T, -1)
            if lat_bias is not None:  # the key bias adds q_nope . b_k to every latent logit of a head
                s_lat = s_lat + lat_bias[..., None]
            parts.append(s_lat)
        scores = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        scores = scores.float().masked_fill_(~mask[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1).to(q.dtype)
        y = None
        Sw = 0
        if k is not None and v is not None:
            K, Sw = k.shape[1], k.shape[2]
            y = head_matmul(p[..., :Sw].reshape(G, K, H // K * T, Sw), v).view(G, H, T, self.dv)
        if latents is None:
            if y is None:
                raise ConfigError("attend: give window keys, latents or both")
            return y
        p_lat = p[..., Sw:]
        c = latents[:, None, :, : self.dc]
        y_lat = torch.matmul(p_lat.reshape(G, 1, H * T, -1), c).view(G, H, T, self.dc)
        return self.absorbed_values(y, y_lat, p_lat.sum(-1, keepdim=True), kv_b_delta)

    def absorbed_queries(
        self, q: torch.Tensor, latents: bool, kv_b_delta: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The absorbed form's queries, softmax scale applied: (q (G, H, T, dn + dr) for the window keys, q_lat
        (G, H, T, dc + dr) for the latents (W_UK folded in, plus ``kv_b_delta``'s q_nope B_k A per row) and the key
        bias's q_nope . b_k (G, H, T) added to every latent score of a head, or None; both None without ``latents``)."""
        q = q * self.scale  # the softmax scale on the (small) query, not on the score matrix
        if not latents:
            return q, None, None
        w_uk, _, bk, _ = self.split_kv_b()
        q_nope, q_rope = torch.split(q, [self.dn, self.dr], dim=-1)
        q_c = per_head(q_nope, w_uk)  # (G, H, T, dc)
        if kv_b_delta is not None:  # + q_nope B_k A per row: (G, H, T, dn) (G, H, dn, r) (G, 1, r, dc)
            A, b_k, _ = self._delta_parts(kv_b_delta, q.shape[0])
            q_c = q_c + torch.matmul(torch.matmul(q_nope, b_k.to(q.dtype)), A[:, None].to(q.dtype))
        bias = torch.einsum("ghtn,hn->ght", q_nope, bk) if bk is not None else None
        return q, torch.cat([q_c, q_rope], dim=-1), bias

    def absorbed_values(
        self,
        y_win: torch.Tensor | None,
        y_lat: torch.Tensor,
        mass: torch.Tensor,
        kv_b_delta: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """(G, H, T, dv): the window's weighted values ``y_win`` (or None) plus the latents' weighted sum ``y_lat``
        (G, H, T, dc) through W_UV (and ``kv_b_delta``'s y_lat A^T B_v^T per row), with the value bias scaled by
        ``mass`` (G, H, T, 1), the weights' sum on the latents."""
        _, w_uv, _, bv = self.split_kv_b()
        y_l = per_head(y_lat, w_uv.transpose(-1, -2))
        if kv_b_delta is not None:  # + y_lat A^T B_v^T per row
            A, _, b_v = self._delta_parts(kv_b_delta, y_lat.shape[0])
            y_r = torch.matmul(y_lat, A[:, None].transpose(-1, -2).to(y_lat.dtype))  # (G, H, T, r)
            y_l = y_l + torch.matmul(y_r, b_v.transpose(-1, -2).to(y_lat.dtype))
        if bv is not None:  # the value bias, weighted by the mass on latents (all of it without a window)
            y_l = y_l + mass * bv[None, :, None, :]
        return y_l if y_win is None else y_win + y_l

    def _delta_parts(
        self, kv_b_delta: tuple[torch.Tensor, torch.Tensor], G: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-row LoRA factors of kv_b -> (A (G, r, dc), B_k (G, H, dn, r), B_v (G, H, dv, r))."""
        A, B = kv_b_delta
        B = B.view(G, self.num_heads, self.dn + self.dv, -1)
        return A, B[:, :, : self.dn], B[:, :, self.dn :]
