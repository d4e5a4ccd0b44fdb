"""The share graft: an MLA model (every layer grafted, one RoPE layout) -> a causal encoder-decoder.

Per layer l of the MLA model (latent ``c_l = W_a,l x``, RoPE key ``k_r,l``, up-projection ``kv_b,l``):

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
  RoPE key stands in for the reader's. Optionally (``rope_fit``, off by default) scaled per frequency: each
  of the reader's RoPE pairs fitted as a complex multiple ``a_f`` of the source's pair of the same frequency
  (least squares on the unrotated keys; a complex scalar is the only linear map that commutes with the
  rotation at every position), folded into the reader's queries (``conj(a_f)`` on each head's RoPE rows) and
  undone in its window keys (``1 / a_f``), so the window's logits are unchanged (what it costs on SmolLM2:
  bench/RESULTS.md). The per-reader relative residuals are reported.
- layers before the first kv_source layer keep only their window.

With every layer a kv_source layer and m = 1 the result equals the MLA model exactly (tested): the
window holds the recent tokens' own keys, the shared path each earlier token's own latent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from tqdm.auto import tqdm

from kvgraft.errors import ConfigError
from kvgraft.graft.layer_stats import run_block
from kvgraft.graft.mla import TAIL_ROWS, rope_tables
from kvgraft.model import ModelConfig, Transformer
from kvgraft.model.ced import CEDAttention
from kvgraft.model.fields import known
from kvgraft.model.mla import MLAttention
from kvgraft.model.transformer import Block


def default_kv_sources(num_layers: int) -> tuple[int, ...]:
    """Pivot at the middle layer; up to 3 encoder kv_source layers spaced below it (8 layers: 1, 3, 4;
    40 layers: 7, 13, 19, 20, DeepSeek-V4.1's spacing)."""
    if num_layers < 2:
        raise ConfigError(f"a causal encoder-decoder needs at least 2 layers, got {num_layers}")
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
    rope_fit: bool = False  # fit each reader's RoPE pairs as complex multiples of the source's (else: the source's as is)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_source_layers", tuple(int(i) for i in self.kv_source_layers))
        if self.ridge < 0:
            raise ConfigError(f"ridge ({self.ridge}) must be >= 0")

    def check_against(self, config: ModelConfig) -> None:
        """Raise ValueError naming the problem when the share graft cannot start from ``config``."""
        kinds = known(config.attention_kinds, "attention_kinds")
        if set(kinds) != {"mla"}:
            raise ConfigError(
                "the share graft starts from a model whose every layer is MLA; convert the original model "
                f"(its attention kinds are {sorted(set(kinds))}) with `kvgraft convert --to ced`"
            )
        if len(set(known(config.rope_freq_index, "rope_freq_index"))) != 1:
            raise ConfigError(
                "the MLA layers use different RoPE frequencies per layer, but shared RoPE keys need one layout; "
                "graft MLA with rope_selection='stride' (what `kvgraft convert --to ced` does)"
            )
        if config.mla_latent_norm:
            raise ConfigError(
                "the share graft needs an MLA model without a latent norm (it folds the latent into each layer's window keys)"
            )
        if config.qk_norm:
            raise ConfigError(
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


class ShareGraft:
    """The share graft as a walk up the MLA stack, one layer at a time: the one implementation of its
    per-layer work, run by ``graft_ced`` (an MLA model in memory) and by the layer-by-layer executor of
    ``kvgraft convert --to ced`` (``kvgraft.graft.ced_layerwise``: the MLA layers grafted as the source's
    blocks are read).

    For each layer in order the caller gives the calibration hidden states entering that layer of the MLA
    stack (``x``: (N, T, h) fp32, the stream of the MLA model itself, run with ``kvgraft.graft.mla._run_block``
    in batches of ``batch_size`` and its last ``TAIL_ROWS`` sequences one at a time, as ``LayerGraft``
    streams it): ``observe(layer, block, x)`` takes the layer's latents ``c_l = W_a,l x`` (where a fit reads
    them) and fits the layer's map ``A = argmin ||c_l - A c_s||`` when it reads another layer's latent (or its
    own, pooled), then ``fill(layer, mla_attention, ced_attention)`` writes the CED attention. What it holds
    across layers: the current kv_source layer's latents (N x T x d_c fp32, on the CPU) and their
    (pooled, intercept-augmented) second moment ((d_c + 1)^2 fp64), one source at a time. Accumulated
    over calibration batches of ``batch_size`` sequences in order, in fp64, as the fits always were."""

    def __init__(self, mla: ModelConfig, g: CEDGraftConfig, batch_size: int = 8) -> None:
        self.g, self.batch_size = g, batch_size
        self.config = ced_config(mla, g)  # validates layers, window and rate
        self.dc, self.m = known(mla.kv_lora_rank, "kv_lora_rank"), g.compress_rate
        sources = {l: self.config.kv_source_of(l) for l in range(mla.num_layers)}
        self.readers = {l: s for l, s in sources.items() if s is not None}  # layer -> the kv_source layer it reads
        self.fitted = [l for l, s in self.readers.items() if s != l or self.m > 1]
        self.read_sources = {self.readers[l] for l in self.fitted}  # kv_source layers whose latents a fit reads
        self.needed = self.read_sources | set(self.fitted)  # layers whose latents are taken
        self.source: int | None = None  # the kv_source layer whose latents are held
        self.source_latents: torch.Tensor | None = None  # (N, T, d_c) fp32
        self.source_rope: torch.Tensor | None = None  # (N, T, d_rope) fp32: its unrotated RoPE keys
        self.dr = known(mla.qk_rope_head_dim, "qk_rope_head_dim")
        self.xx: torch.Tensor | None = None  # (d_c + 1)^2 fp64: its pooled latents' second moment
        # layer -> (latent map, its relative residual, RoPE scales a_f or None, their relative residual), until filled
        self.fits: dict[int, tuple[torch.Tensor, float, torch.Tensor | None, float | None]] = {}
        self.report: dict[str, Any] = {
            "kv_source_layers": list(g.kv_source_layers),
            "pivot": self.config.pivot_layer,
            "sliding_window": g.sliding_window,
            "compress_rate": self.m,
            "readers": {},
        }

    def streams_past(self, layer: int) -> bool:
        """Whether a layer above ``layer`` takes latents (the stream must be run past ``layer``)."""
        return any(l > layer for l in self.needed)

    def _batches(self, n: int) -> range:
        return range(0, n, self.batch_size)

    def latents(self, block: Block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, T, d_c) and (N, T, d_rope) fp32 on the CPU: the latents and unrotated RoPE keys the MLA ``block``
        computes for its input ``x``, a calibration batch at a time (its attention's ``kv_a_proj`` of the
        normalised input)."""
        attn = cast(MLAttention, block.self_attn)
        out = [attn.kv_a_proj(block.input_layernorm(x[s : s + self.batch_size])).cpu() for s in self._batches(x.shape[0])]
        full = torch.cat(out)
        return full[..., : self.dc].contiguous(), full[..., self.dc :].contiguous()

    def rope_scales(self, rope: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The complex scale per RoPE pair (d_rope / 2 complex, fp64) that best maps the held source's unrotated
        RoPE keys onto ``rope`` (a reader's, (N, T, d_rope)), and the fit's relative residual. Pairs are
        (i, i + d_rope / 2), the rotate-half layout of ``apply_rope``."""
        if self.source_rope is None:
            raise RuntimeError("share graft: no source RoPE keys held")
        n = self.dr // 2
        num = torch.zeros(n, dtype=torch.complex128)
        den = torch.zeros(n, dtype=torch.float64)
        yy = torch.zeros(n, dtype=torch.float64)
        for s in self._batches(rope.shape[0]):
            xs = self.source_rope[s : s + self.batch_size].double().reshape(-1, self.dr)
            ys = rope[s : s + self.batch_size].double().reshape(-1, self.dr)
            zx, zy = torch.complex(xs[:, :n], xs[:, n:]), torch.complex(ys[:, :n], ys[:, n:])
            num += (zx.conj() * zy).sum(0)
            den += zx.abs().pow(2).sum(0)
            yy += zy.abs().pow(2).sum(0)
        a = torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))
        resid = (yy - a.abs().pow(2) * den).sum() / yy.sum().clamp_min(1e-300)
        # a floor on |a_f| (its phase kept): the window keys divide by it
        floor = 1e-3 * float(a.abs().max()) if bool((a.abs() > 0).any()) else 1.0
        small = a.abs() < floor
        a = torch.where(small, torch.polar(torch.full_like(den, floor), torch.where(a.abs() > 0, a.angle(), 0.0)), a)
        return a, float(resid)

    def observe(self, layer: int, block: Block, x: torch.Tensor) -> None:
        """Take ``layer``'s latents where a fit needs them (``x``: the MLA stack's hidden states entering
        ``layer``); a kv_source layer's replace the held source's; a fitted reader's map is solved now."""
        if layer not in self.needed:
            return
        c, rope = self.latents(block, x)
        m, bs = self.m, self.batch_size
        if layer in self.read_sources:
            self.source, self.source_latents, self.source_rope = layer, c, rope
            xx = torch.zeros(self.dc + 1, self.dc + 1, dtype=torch.float64)
            for s in self._batches(c.shape[0]):
                xs = _augmented(_pool(c[s : s + bs].double(), m))
                xx += xs.T @ xs
            self.xx = xx
        if layer not in self.fitted:
            return
        if self.source != self.readers[layer] or self.source_latents is None or self.xx is None:
            raise RuntimeError(f"share graft: layer {layer} reads layer {self.readers[layer]}, whose latents are not held")
        xy = torch.zeros(self.dc + 1, self.dc, dtype=torch.float64)
        yy = torch.zeros((), dtype=torch.float64)
        for s in self._batches(c.shape[0]):
            xs = _augmented(_pool(self.source_latents[s : s + bs].double(), m))
            y = _pool(c[s : s + bs].double(), m)
            xy += xs.T @ y
            yy += (y**2).sum()
        k = self.dc + 1 if self.config.qkv_bias else self.dc  # an intercept only where kv_b's bias can hold it
        reg = self.xx[:k, :k].clone()
        reg.diagonal()[: self.dc] += self.g.ridge * reg.diagonal()[: self.dc].mean()
        sol = torch.linalg.solve(reg, xy[:k])  # (k, dc): c_l ~ sol[:dc]^T c_s (+ sol[dc])
        resid = (yy - (sol * xy[:k]).sum()) / yy  # relative residual of the fit
        scales, rope_resid = None, None
        if self.g.rope_fit and self.readers[layer] != layer:
            scales, rope_resid = self.rope_scales(rope)
        self.fits[layer] = (sol, float(resid), scales, rope_resid)

    def fill(self, layer: int, old: MLAttention, attn: CEDAttention) -> None:
        """Write ``layer``'s CED attention ``attn`` (every parameter) from the MLA attention ``old`` and the
        layer's fit (``observe`` first); its reader entry goes to ``report``."""
        cfg, dc, m = self.config, self.dc, self.m
        for name, p in attn.named_parameters():  # every parameter is written below; zero first all the same
            p.detach().fill_(1.0 if name.endswith("norm.weight") else 0.0)
        H, dn, dr, dv = (
            cfg.num_heads,
            known(cfg.qk_nope_head_dim, "qk_nope_head_dim"),
            known(cfg.qk_rope_head_dim, "qk_rope_head_dim"),
            known(cfg.v_head_dim, "v_head_dim"),
        )
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
        source = self.readers.get(layer)
        if source is None:  # attn.source: a layer before the first kv_source layer keeps only its window
            return
        if layer not in self.fitted:  # a kv_source layer reading its own latent (m == 1): unchanged
            attn.kv_b_proj.load_state_dict(old.kv_b_proj.state_dict())
            return
        sol, resid, scales, rope_resid = self.fits.pop(layer)
        if scales is not None:
            _fold_rope_scales(attn, scales, H, dn, dr)
        w_b2 = w_b.reshape(H * (dn + dv), dc)
        attn.kv_b_proj.weight.copy_((w_b2 @ sol[:dc].T).to(dtype))
        if sol.shape[0] > dc:
            bias = attn.kv_b_proj.bias
            if bias is None or b_b is None:  # k > dc only where kv_b has a bias, here as in the MLA model
                raise RuntimeError(f"share graft: layer {layer}'s up-projection bias is missing")
            bias.copy_((w_b2 @ sol[dc] + b_b.reshape(-1)).to(dtype))
        self.report["readers"][layer] = {"source": source, "relative_residual": resid}
        if rope_resid is not None:
            self.report["readers"][layer]["rope_relative_residual"] = rope_resid

    def ced_block(self, layer: int, mla_block: Block) -> Block:
        """``layer`` of the causal encoder-decoder: its CED attention (``fill``) between ``mla_block``'s own
        norms and MLP (shared, not copied), built without random initialisation."""
        with torch.device("meta"):
            blk = Block(self.config, layer)
        blk.input_layernorm = mla_block.input_layernorm
        blk.post_attention_layernorm = mla_block.post_attention_layernorm
        blk.mlp = mla_block.mlp
        device = mla_block.input_layernorm.weight.device
        blk.self_attn = blk.self_attn.to_empty(device=device)
        self.fill(layer, cast(MLAttention, mla_block.self_attn), cast(CEDAttention, blk.self_attn))
        return blk.eval()

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What the walk holds across layers (for a checkpoint): tensors and a JSON-ready state."""
        tensors = {}
        if self.source_latents is not None and self.xx is not None and self.source_rope is not None:
            tensors = {"share/source_latents": self.source_latents, "share/xx": self.xx, "share/source_rope": self.source_rope}
        return tensors, {"source": self.source, "readers": {str(k): v for k, v in self.report["readers"].items()}}

    def restore(self, tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        """The walk as ``state()`` left it."""
        self.source = state["source"]
        self.source_latents, self.xx = tensors.get("share/source_latents"), tensors.get("share/xx")
        self.source_rope = tensors.get("share/source_rope")
        self.report["readers"] = {int(k): v for k, v in state["readers"].items()}


def _fold_rope_scales(attn: CEDAttention, scales: torch.Tensor, H: int, dn: int, dr: int) -> None:
    """A reader that sees the source's RoPE key k_s where its own was ~ a * k_s (per pair, complex): its queries'
    RoPE rows times conj(a) (so q' . k_s = q . (a k_s)) and its window keys' RoPE rows times 1 / a (so the window
    logits q' . k' = q . k are unchanged). Rows of weights and biases, per head, in the rotate-half layout."""
    n = dr // 2

    def apply(param: torch.Tensor, heads: int, factor: torch.Tensor) -> None:
        rows = param.data.double().view(heads, dn + dr, -1)
        re, im = rows[:, dn : dn + n].clone(), rows[:, dn + n :].clone()
        fr, fi = factor.real.view(1, n, 1), factor.imag.view(1, n, 1)
        rows[:, dn : dn + n] = fr * re - fi * im  # (fr + i fi)(re + i im)
        rows[:, dn + n :] = fr * im + fi * re
        param.data.copy_(rows.view_as(param.data).to(param.dtype))

    for proj, factor in ((attn.q_proj, scales.conj()), (attn.k_proj, 1 / scales)):
        apply(proj.weight, H, factor)
        if proj.bias is not None:
            apply(proj.bias[:, None], H, factor)


def _augmented(x: torch.Tensor) -> torch.Tensor:
    """(n, d) -> (n, d + 1): a column of ones appended (the intercept)."""
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)


@torch.no_grad()
def graft_ced(
    mla: Transformer,
    g: CEDGraftConfig,
    calibration: torch.Tensor,  # (N, T) token ids
    batch_size: int = 8,
    progress: bool = True,
) -> tuple[Transformer, dict[str, Any]]:
    """Return (causal encoder-decoder, report) built from the all-MLA model ``mla`` (left untouched): the
    calibration stream run up the MLA model's layers, each layer's latents fitted and its CED attention
    written as the stream passes (``ShareGraft``)."""
    cfg = mla.config
    g.check_against(cfg)
    walk = ShareGraft(cfg, g, batch_size)
    device = mla.embed_tokens.weight.device
    new = Transformer(walk.config).to(device)
    state = {k: v for k, v in mla.state_dict().items() if ".self_attn." not in k}
    result = new.load_state_dict(state, strict=False)  # everything outside attention carries over as is
    outside = [k for k in result.missing_keys + result.unexpected_keys if ".self_attn." not in k]
    if outside:
        raise RuntimeError(f"share graft: tensors outside attention do not carry over: {outside}")
    calibration = calibration.to(device)
    x = mla.embed_tokens(calibration).float()
    cos, sin = rope_tables(mla.rotary, calibration.shape[0], calibration.shape[1])
    for layer in tqdm(range(cfg.num_layers), desc="share graft", unit="layer", disable=not progress):
        block = cast(Block, mla.layers[layer])
        walk.observe(layer, block, x)
        walk.fill(layer, _mla_attention(mla, layer), cast(CEDAttention, cast(Block, new.layers[layer]).self_attn))
        if walk.streams_past(layer):
            x = run_block(block, x, cos, sin, batch_size, TAIL_ROWS)
    return new, walk.report
