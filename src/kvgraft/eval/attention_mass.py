"""How much of a causal encoder-decoder's attention lands on the shared compressed stream, not the windows.

Every CED layer attends in one softmax over its own sliding window and the shared entries written by its
kv_source layer (``kvgraft.model.ced``). For the positions that predict a task's answer tokens (the prompt's
last position through the answer's second-to-last), :func:`shared_attention_share` measures, per layer that
reads a shared stream, the softmax mass on the shared entries (1 - the mass on the window), averaged over
heads, those positions and the examples. On the ``recall`` task the answer lies beyond every window, so the
shared stream is the only way to it; the figure says how much the stream carries on a given task.

The probabilities are recomputed next to the model's own attention call (same queries, keys, latents and
mask, expanded path: the model runs without a cache), so nothing about the forward changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvgraft.data.tasks import encode_example
from kvgraft.errors import ConfigError
from kvgraft.model.ced import CEDAttention


@dataclass
class SharedShare:
    """``per_layer[l]``: mean shared-stream share at layer l (None: the layer reads no shared stream);
    ``mean``: over the reading layers; ``examples`` and ``positions``: how many were averaged."""

    per_layer: list[float | None]
    mean: float
    examples: int
    positions: int

    def to_dict(self) -> dict:
        return {"per_layer": self.per_layer, "mean": self.mean, "examples": self.examples, "positions": self.positions}


def _shared_mass(attn, q, k, latents, mask) -> torch.Tensor:
    """(G, H, T) softmax mass on the shared entries, as ``LatentAttention._attend_expanded`` attends."""
    G, H, T, _ = q.shape
    parts = []
    if k is not None:
        parts.append(torch.matmul(q, k.repeat_interleave(H // k.shape[1], dim=1).transpose(-1, -2)))
    window = parts[0].shape[-1] if parts else 0
    N = latents.shape[1]
    c, k_rope = latents[..., : attn.dc], latents[..., attn.dc : attn.dc + attn.dr]
    w, b = attn.weights("kv_b_proj")
    kv = F.linear(c, w, b).view(G, N, H, attn.dn + attn.dv).transpose(1, 2)
    keys = torch.cat([kv[..., : attn.dn], k_rope[:, None].expand(G, H, N, attn.dr)], dim=-1)
    parts.append(torch.matmul(q, keys.transpose(-1, -2)))
    scores = (torch.cat(parts, dim=-1) * attn.scale).float().masked_fill(~mask[:, None], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return p[..., window:].sum(-1)


@torch.no_grad()
def shared_attention_share(model, sequences: Sequence[tuple[Sequence[int], int, int]]) -> SharedShare:
    """``model``: a kvgraft causal encoder-decoder (``Transformer`` with ``kv_source_layers``; LoRA-wrapped
    projections are fine). ``sequences``: (token ids, first, last) with positions ``first..last`` (inclusive)
    the ones averaged, e.g. the positions predicting the answer: ``first = len(prompt) - 1``, ``last =
    len(prompt) + len(answer) - 2``. Each sequence runs alone (batch 1, no cache)."""

    layers = [b.self_attn for b in model.layers]
    if not any(isinstance(a, CEDAttention) and a.source is not None for a in layers):
        raise ConfigError(
            "shared_attention_share needs a causal encoder-decoder (layers that read a shared stream); this model has none"
        )
    for ids, first, last in sequences:
        if not 0 <= first <= last < len(ids):
            raise ConfigError(f"positions {first}..{last} are not inside a sequence of {len(ids)} tokens")
    sums = [0.0] * len(layers)
    current: dict[int, torch.Tensor] = {}
    originals = {}
    for i, attn in enumerate(layers):
        if not isinstance(attn, CEDAttention) or attn.source is None:
            continue

        def wrapped(q, k, v, latents, mask, absorbed, kv_b_delta=None, _attn=attn, _i=i):
            if latents is not None:
                current[_i] = _shared_mass(_attn, q, k, latents, mask)
            return type(_attn).attend(_attn, q, k, v, latents, mask, absorbed, kv_b_delta)

        originals[i] = attn.__dict__.get("attend")
        attn.attend = wrapped  # type: ignore[method-assign]  # this instance only, restored in the finally below
    was_training = model.training
    model.eval()
    positions = 0
    device = next(model.parameters()).device
    try:
        for ids, first, last in sequences:
            current.clear()
            model(torch.tensor([list(ids)], dtype=torch.long, device=device))
            for i, mass in current.items():  # (1, H, T)
                sums[i] += float(mass[0, :, first : last + 1].mean(0).sum())
            positions += last - first + 1
    finally:
        for i, orig in originals.items():
            if orig is None:
                del layers[i].attend
            else:
                layers[i].attend = orig
        model.train(was_training)
    per_layer = [sums[i] / positions if i in originals else None for i in range(len(layers))]
    reading = [v for v in per_layer if v is not None]
    return SharedShare(per_layer=per_layer, mean=sum(reading) / len(reading), examples=len(sequences), positions=positions)


def task_sequences(tokenizer, examples, max_len: int) -> list[tuple[list[int], int, int]]:
    """(ids, first, last) of each task example: the positions that predict its answer tokens (the EOS
    after the answer not included)."""

    out = []
    for e in examples:
        ids, labels = encode_example(tokenizer, e, max_len=max_len)
        answer = [i for i, lab in enumerate(labels) if lab != -100]  # answer tokens and the EOS
        first, last = answer[0] - 1, answer[-1] - 2  # predicting answer[0] .. the last answer token
        out.append((ids, first, max(first, last)))
    return out


__all__ = ["SharedShare", "shared_attention_share", "task_sequences"]
