"""The share graft: an MLA model (every layer grafted, one RoPE layout) -> a causal encoder-decoder.

Nobody else converts a pretrained model to cross-layer shared compressed KV. Per layer l of the MLA
model (latent ``c_l = W_a,l x``, RoPE key ``k_r,l``, up-projection ``kv_b,l``):

- its **window** keeps exactly the keys and values it computed before: ``k_proj`` = ``[W_UK,l W_a,l ;
  W_r,l]`` per head (the latent folded in, the RoPE key repeated per head), ``v_proj`` = ``W_UV,l W_a,l``;
  so within the window the layer is unchanged (window heads = query heads);
- a **kv_source** layer s keeps its down-projection as the compressor (``kv_a``); with m > 1 the gate
  starts at zero, i.e. a plain mean over each block;
- a **reading** layer l (source s = nearest kv_source at or before l) reads s's latent through a new
  up-projection fitted by least squares on calibration activations: ``A = argmin ||c_l - A c_s||``
  over the (pooled) calibration tokens, then ``kv_b'_l = kv_b,l A`` (and the intercept into the bias
  when the model has biases). Multi-output least squares does not depend on the metric of the output,
  so fitting in latent space gives the same map as fitting keys and values directly. The source's own
  RoPE key stands in for the reader's; the per-reader relative residual is reported.
- layers before the first kv_source layer keep only their window.

With every layer a kv_source layer and m = 1 the result equals the MLA model exactly (tested): the
window holds the recent tokens' own keys, the shared path each earlier token's own latent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from tqdm.auto import tqdm

from kvgraft.model import ModelConfig, Transformer
from kvgraft.model.ced import CEDAttention
from kvgraft.model.fields import known
from kvgraft.model.mla import MLAttention
from kvgraft.model.transformer import Block


def default_kv_sources(num_layers: int) -> tuple[int, ...]:
    """Pivot at the middle layer; up to 3 encoder kv_source layers spaced below it (8 layers: 1, 3, 4;
    40 layers: 7, 13, 19, 20, DeepSeek-V4.1's spacing)."""
    if num_layers < 2:
        raise ValueError(f"a causal encoder-decoder needs at least 2 layers, got {num_layers}")
    pivot = num_layers // 2
    n_enc = min(3, max(1, pivot // 2)) if pivot >= 2 else 0
    step = max(1, pivot // max(n_enc, 1))
    enc = sorted({pivot - 1 - step * k for k in range(n_enc) if pivot - 1 - step * k >= 0})
    return (*enc, pivot)


@dataclass(frozen=True)
class CEDGraftConfig:
    kv_source_layers: tuple[int, ...]
    sliding_window: int = 64
    compress_rate: int = 1
    ridge: float = 1e-6  # relative to the mean eigenvalue of the source latents' second moment

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_source_layers", tuple(int(i) for i in self.kv_source_layers))
        if self.ridge < 0:
            raise ValueError(f"ridge ({self.ridge}) must be >= 0")

    def check_against(self, config: ModelConfig) -> None:
        """Raise ValueError naming the problem when the share graft cannot start from ``config``."""
        kinds = known(config.attention_kinds, "attention_kinds")
        if set(kinds) != {"mla"}:
            raise ValueError(
                "the share graft starts from a model whose every layer is MLA; convert the original model "
                f"(its attention kinds are {sorted(set(kinds))}) with `kvgraft convert --to ced`"
            )
        if len(set(known(config.rope_freq_index, "rope_freq_index"))) != 1:
            raise ValueError(
                "the MLA layers use different RoPE frequencies per layer, but shared RoPE keys need one layout; "
                "graft MLA with rope_selection='stride' (what `kvgraft convert --to ced` does)"
            )
        if config.mla_latent_norm:
            raise ValueError(
                "the share graft needs an MLA model without a latent norm (it folds the latent into each layer's window keys)"
            )
        if config.qk_norm:
            raise ValueError(
                "the share graft needs an MLA model without per-head query/key norms (Qwen3): "
                "convert the original checkpoint with `kvgraft convert --to ced`, which replaces both "
                "norms by their least-squares linear fits (GraftConfig(qk_norm='linearise'))"
            )
        ced_config(config, self)  # validates layers, window and rate with the config's own errors


def ced_config(mla: ModelConfig, g: CEDGraftConfig) -> ModelConfig:
    """The causal encoder-decoder config of the graft: window heads = query heads, MLA widths kept."""
    return mla.replace(
        attention_kinds=None,
        layer_types=None,
        kv_slots=None,
        rope_freq_index=(known(mla.rope_freq_index, "rope_freq_index")[0],) * mla.num_layers,
        kv_source_layers=g.kv_source_layers,
        sliding_window=g.sliding_window,
        compress_rate=g.compress_rate,
        num_kv_heads=mla.num_heads,
    )


def _mla_attention(model: Transformer, layer: int) -> MLAttention:
    """Layer ``layer``'s attention of the all-MLA ``model``."""
    return cast(MLAttention, cast(Block, model.layers[layer]).self_attn)


def _pool(c: torch.Tensor, m: int) -> torch.Tensor:
    """(B, T, d) -> (B * T // m, d): the mean of each complete block (the zero-gate pooling)."""
    B, T, d = c.shape
    n = T // m
    return c[:, : n * m].reshape(B, n, m, d).mean(dim=2).reshape(B * n, d)


@torch.no_grad()
def graft_ced(
    mla: Transformer,
    g: CEDGraftConfig,
    calibration: torch.Tensor,  # (N, T) token ids
    batch_size: int = 8,
    progress: bool = True,
) -> tuple[Transformer, dict[str, Any]]:
    """Return (causal encoder-decoder, report) built from the all-MLA model ``mla`` (left untouched)."""
    cfg = mla.config
    g.check_against(cfg)
    new_cfg = ced_config(cfg, g)
    device = mla.embed_tokens.weight.device
    dc, m = known(cfg.kv_lora_rank, "kv_lora_rank"), g.compress_rate
    sources = {l: new_cfg.kv_source_of(l) for l in range(cfg.num_layers)}
    readers = {l: s for l, s in sources.items() if s is not None}  # layer -> the kv_source layer it reads
    fitted = [l for l, s in readers.items() if s != l or m > 1]

    # second moments of the (pooled, intercept-augmented) source latents and their cross moments with
    # each fitted reader's latent, accumulated over calibration batches of the MLA model's own forward
    aug = dc + 1
    xx = {s: torch.zeros(aug, aug, dtype=torch.float64) for s in set(readers[l] for l in fitted)}
    xy = {l: torch.zeros(aug, dc, dtype=torch.float64) for l in fitted}
    yy = {l: torch.zeros((), dtype=torch.float64) for l in fitted}
    latents: dict[int, torch.Tensor] = {}
    hooks = []
    for layer in range(cfg.num_layers):

        def keep(module: nn.Module, args: Any, out: torch.Tensor, layer: int = layer) -> None:
            latents[layer] = out[..., :dc].double().cpu()

        hooks.append(_mla_attention(mla, layer).kv_a_proj.register_forward_hook(keep))
    try:
        batches = range(0, calibration.shape[0], batch_size)
        for start in tqdm(batches, desc="share graft: calibrate", unit="batch", disable=not progress):
            latents.clear()
            mla(calibration[start : start + batch_size].to(device))
            pooled = {l: _pool(c, m) for l, c in latents.items()}
            ones = torch.ones(next(iter(pooled.values())).shape[0], 1, dtype=torch.float64)
            for s in xx:
                xs = torch.cat([pooled[s], ones], dim=1)
                xx[s] += xs.T @ xs
            for l in fitted:
                xs = torch.cat([pooled[readers[l]], ones], dim=1)
                xy[l] += xs.T @ pooled[l]
                yy[l] += (pooled[l] ** 2).sum()
    finally:
        for h in hooks:
            h.remove()

    new = Transformer(new_cfg).to(device)
    state = {k: v for k, v in mla.state_dict().items() if ".self_attn." not in k}
    result = new.load_state_dict(state, strict=False)  # everything outside attention carries over as is
    outside = [k for k in result.missing_keys + result.unexpected_keys if ".self_attn." not in k]
    if outside:
        raise RuntimeError(f"share graft: tensors outside attention do not carry over: {outside}")
    H, dn, dr, dv = (
        cfg.num_heads,
        known(cfg.qk_nope_head_dim, "qk_nope_head_dim"),
        known(cfg.qk_rope_head_dim, "qk_rope_head_dim"),
        known(cfg.v_head_dim, "v_head_dim"),
    )
    report: dict[str, Any] = {
        "kv_source_layers": list(g.kv_source_layers),
        "pivot": new_cfg.pivot_layer,
        "sliding_window": g.sliding_window,
        "compress_rate": m,
        "readers": {},
    }
    for layer in range(cfg.num_layers):
        old = _mla_attention(mla, layer)
        attn = cast(CEDAttention, cast(Block, new.layers[layer]).self_attn)
        dtype = attn.q_proj.weight.dtype
        w_a = old.kv_a_proj.weight.double()  # (dc + dr, h)
        b_a = old.kv_a_proj.bias.double() if old.kv_a_proj.bias is not None else None
        w_b = old.kv_b_proj.weight.double().view(H, dn + dv, dc)
        b_b = old.kv_b_proj.bias.double().view(H, dn + dv) if old.kv_b_proj.bias is not None else None
        w_uk, w_uv = w_b[:, :dn], w_b[:, dn:]
        # window keys [W_UK W_a,c ; W_a,r] per head and values W_UV W_a,c: the layer's own keys/values
        k_w = torch.cat([w_uk @ w_a[:dc], w_a[dc:].expand(H, dr, -1)], dim=1).reshape(H * (dn + dr), -1)
        v_w = (w_uv @ w_a[:dc]).reshape(H * dv, -1)
        attn.q_proj.load_state_dict(old.q_proj.state_dict())
        attn.o_proj.load_state_dict(old.o_proj.state_dict())
        attn.k_proj.weight.copy_(k_w.to(dtype))
        attn.v_proj.weight.copy_(v_w.to(dtype))
        if attn.k_proj.bias is not None:
            ba_c = b_a[:dc] if b_a is not None else torch.zeros(dc, dtype=torch.float64)
            ba_r = b_a[dc:] if b_a is not None else torch.zeros(dr, dtype=torch.float64)
            bk = w_uk @ ba_c + (b_b[:, :dn] if b_b is not None else 0)
            bv = w_uv @ ba_c + (b_b[:, dn:] if b_b is not None else 0)
            attn.k_proj.bias.copy_(torch.cat([bk, ba_r.expand(H, dr)], dim=1).reshape(-1).to(dtype))
            attn.v_proj.bias.copy_(bv.reshape(-1).to(dtype))
        if attn.is_source:
            attn.compressor.kv_a_proj.load_state_dict(old.kv_a_proj.state_dict())
            if m > 1:  # zero gates: each block starts as the plain mean of its tokens' entries
                attn.compressor.gate_proj.weight.zero_()
                attn.compressor.gate_bias.zero_()
        source = readers.get(layer)
        if source is None:  # attn.source: a layer before the first kv_source layer keeps only its window
            continue
        if layer not in fitted:  # a kv_source layer reading its own latent (m == 1): unchanged
            attn.kv_b_proj.load_state_dict(old.kv_b_proj.state_dict())
            continue
        k = dc + 1 if attn.kv_b_proj.bias is not None else dc  # an intercept only where a bias can hold it
        reg = xx[source][:k, :k].clone()
        reg.diagonal()[:dc] += g.ridge * reg.diagonal()[:dc].mean()
        sol = torch.linalg.solve(reg, xy[layer][:k])  # (k, dc): c_l ~ sol[:dc]^T c_s (+ sol[dc])
        resid = (yy[layer] - (sol * xy[layer][:k]).sum()) / yy[layer]  # relative residual of the fit
        w_b2 = w_b.reshape(H * (dn + dv), dc)
        attn.kv_b_proj.weight.copy_((w_b2 @ sol[:dc].T).to(dtype))
        if k > dc:
            bias = attn.kv_b_proj.bias
            if bias is None or b_b is None:  # k > dc only where kv_b has a bias, here as in the MLA model
                raise RuntimeError(f"share graft: layer {layer}'s up-projection bias is missing")
            bias.copy_((w_b2 @ sol[dc] + b_b.reshape(-1)).to(dtype))
        report["readers"][layer] = {"source": source, "relative_residual": float(resid)}
    return new, report
