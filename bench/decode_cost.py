"""Both sides of the decode trade: bytes read and FLOPs per decode step, GQA vs absorbed MLA vs the causal
encoder-decoder (CED), by context and batch, beside measured CPU step time.

    .venv/bin/python bench/decode_cost.py --analytic-only                  # the tables, no timing
    .venv/bin/python bench/decode_cost.py --threads 2                      # + CPU timings (default grid)
    .venv/bin/python bench/decode_cost.py --threads 2 --contexts 1024 4096 8192 --batches 1 4 16

**Analytic part** (:func:`step_cost`, derived from a ``ModelConfig`` layer by layer, exactly as kvgraft's
runtime executes one decode step of one new token per row, T = 1). FLOPs are matmul FLOPs (2 per
multiply-add), the ones ``torch.utils.flop_counter.FlopCounterMode`` counts; elementwise work (softmax,
masking, RoPE, norms) is left out of FLOPs and shown instead as the size of the fp32 score matrix.
Bytes read are the ideal ones: every weight the step applies, once per step (whatever the batch), plus
the cache bytes the attention reads. The runtime also *gathers* each row's blocks into a contiguous copy
(``kvgraft.model.batch.BatchContext``: read + write of the paged cache, ring copies) before attending;
that extra traffic is reported separately (``copy``). Arithmetic intensity = FLOPs / ideal bytes.
``tests/test_decode_cost.py`` checks the FLOPs against FlopCounterMode on one real step, the weight
bytes against the parameter count and the cache bytes against the cache's own layout.

**Measured part** (CPU, fp32, ``--threads``): ``--layers`` layers of the same shape with random weights,
one paged cache per model pre-filled with random values to ``context`` tokens (no prefill is run), then
``--warmup`` untimed and ``--steps`` timed single-token steps for all rows. The three models are
interleaved step by step in a rotating order in one process, so a slow spell hits all alike; per model
the median step time is reported, and its ratio to GQA's (>1: faster than GQA). Next to it the roofline
time ``max(FLOPs / peak, bytes / bandwidth)`` with the peak fp32 matmul rate and the read bandwidth
measured on this machine at the start of the run (``--no-roofline`` skips it).

Shapes: ``1b`` = Llama-3.2-1B-like (hidden 2048, 32 q / 8 KV heads of 64, SwiGLU 8192, vocab 32000;
the analytic table uses all 16 layers, the timing ``--layers``), MLA at 4x compression by the default rank
rule (d_c 192 + d_rope 64 = 256 cached values per token per layer vs 1024), and a CED of the same widths
(window heads 8 of 64+64 / 64, kv_source layers at 1/8, 3/8 and 1/2 of the depth, window ``--window``,
pooling rate ``--compress-rate``). ``8m`` = the shipped reference shapes (llama-8m, its 4x MLA graft, ced-8m).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvgraft.atomic import atomic_write_json
from kvgraft.graft.ranks import default_ranks  # noqa: E402
from kvgraft.model import ModelConfig, Transformer  # noqa: E402
from kvgraft.model.presets import get_preset  # noqa: E402

KINDS = ("gqa", "mla", "ced")


# ---- shapes ---------------------------------------------------------------------------------------------
def one_b(layers: int = 16) -> ModelConfig:
    from bench_shapes import one_b_config

    return one_b_config(layers)


def mla_of(cfg: ModelConfig, compression: float = 4.0) -> ModelConfig:
    """The MLA graft's config (kvgraft.graft.mla.mla_model_config): every layer MLA, d_nope = d_v = head_dim,
    (d_c, d_rope) by the default rank rule at ``compression``."""
    r = default_ranks(cfg, compression=compression)
    return cfg.replace(
        attention_kinds=("mla",) * cfg.num_layers,
        kv_lora_rank=r.kv_lora_rank,
        qk_rope_head_dim=r.qk_rope_head_dim,
        qk_nope_head_dim=cfg.head_dim,
        v_head_dim=cfg.head_dim,
    )


def ced_sources(layers: int) -> tuple[int, ...]:
    """kv_source layers at 1/8, 3/8 and 1/2 of the depth (ced-8m's 1, 3, 4 of 8); (1, 2) for 4 layers."""
    if layers < 8:
        return tuple(range(1, max(2, layers // 2 + 1)))
    return tuple(sorted({layers // 8, 3 * layers // 8, layers // 2}))


def ced_of(cfg: ModelConfig, mla: ModelConfig, window: int, compress_rate: int) -> ModelConfig:
    """A native CED with the MLA graft's latent widths and the original's KV heads for the windows."""
    return cfg.replace(
        kv_source_layers=ced_sources(cfg.num_layers),
        sliding_window=window,
        compress_rate=compress_rate,
        kv_lora_rank=mla.kv_lora_rank,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        v_head_dim=mla.v_head_dim,
        mla_latent_norm=True,
    )


def configs(shape: str, layers: int | None = None, window: int = 128, compress_rate: int = 2) -> dict[str, ModelConfig]:
    if shape == "1b":
        base = one_b(layers or 16)
        mla = mla_of(base)
        return {"gqa": base, "mla": mla, "ced": ced_of(base, mla, window, compress_rate)}
    if shape == "8m":
        base = get_preset("llama-8m")
        if layers:
            base = base.replace(num_layers=layers)
        ced = get_preset("ced-8m")
        if layers:
            ced = ced.replace(num_layers=layers, kv_source_layers=ced_sources(layers))
        return {"gqa": base, "mla": mla_of(base), "ced": ced}
    raise ValueError(f"unknown shape {shape!r} (1b or 8m)")


# ---- the analytic cost of one decode step ---------------------------------------------------------------
@dataclass
class StepCost:
    flops: int = 0  # matmul FLOPs of the step (what FlopCounterMode counts)
    attn_flops: int = 0  # the part that grows with the context: scores and values over cached keys
    weight_params: int = 0  # parameters the step reads (each once, whatever the batch)
    cache_read: int = 0  # cache values the attention reads (all rows, all layers)
    cache_copy: int = 0  # values the runtime's gather moves on top (read + write of each copy)
    score_elems: int = 0  # entries of the fp32 score matrices (all rows, heads, keys, layers)
    cache_stored: int = 0  # cache values one sequence holds at this context (all layers)
    itemsize: int = 4

    @property
    def weight_bytes(self) -> int:
        return self.weight_params * self.itemsize

    @property
    def cache_bytes(self) -> int:
        return self.cache_read * self.itemsize

    @property
    def bytes(self) -> int:
        """Ideal bytes read: weights once plus the cache the attention reads."""
        return self.weight_bytes + self.cache_bytes

    @property
    def runtime_bytes(self) -> int:
        """Bytes with the gather copies of the current runtime added (and the fp32 scores written + read once)."""
        return self.bytes + self.cache_copy * self.itemsize + 2 * 4 * self.score_elems

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def mla_folds(cfg: ModelConfig) -> tuple[bool, bool]:
    """(fold_q, fold_o) exactly as kvgraft.model.mla.MLAttention decides them."""
    q_in = cfg.head_dim if cfg.qk_norm else cfg.hidden_size
    dc, dn, dv, h = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.hidden_size
    return q_in * dc <= q_in * dn + dn * dc, dc * h <= dc * dv + dv * h


def step_cost(cfg: ModelConfig, context: int, batch: int, itemsize: int = 4, max_len: int | None = None) -> StepCost:
    """Cost of one decode step: ``batch`` rows each holding ``context`` cached tokens add one token.

    ``max_len`` is the length the cache was allocated for (it bounds window rings: ``min(W, max_len)``
    slots, all scored, unwritten ones masked); default ``context + 1``. The absorbed path is assumed
    for MLA/CED layers (kvgraft's "auto" at decode).
    """
    B, S = batch, context
    L = S + 1  # keys of a full-attention layer: every cached token and the new one (written, then read)
    max_len = context + 1 if max_len is None else max_len
    h, H, K, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    c = StepCost(itemsize=itemsize)

    def lin(n_in: int, n_out: int, bias: bool = False) -> None:  # y = x W^T (+ b), B rows
        c.flops += 2 * B * n_in * n_out
        c.weight_params += n_in * n_out + (n_out if bias else 0)

    def attend(heads: int, keys: int, dk: int, dv: int) -> None:  # scores over dk, then values over dv
        f = 2 * B * heads * keys * (dk + dv)
        c.flops += f
        c.attn_flops += f
        c.score_elems += B * heads * keys

    ring = min(cfg.sliding_window, max_len) if cfg.sliding_window else 0
    copied_segments: set[int] = set()
    for layer, kind in enumerate(cfg.attention_kinds):
        c.weight_params += 2 * h  # the block's two RMSNorms
        lin(h, cfg.intermediate_size, cfg.mlp_bias)  # SwiGLU gate, up, down
        lin(h, cfg.intermediate_size, cfg.mlp_bias)
        lin(cfg.intermediate_size, h, cfg.mlp_bias)
        qkv_b, o_b = cfg.qkv_bias, cfg.o_bias
        if kind == "gqa":
            lin(h, H * d, qkv_b)
            if cfg.is_kv_writer(layer):
                lin(h, K * d, qkv_b)
                lin(h, K * d, qkv_b)
                if cfg.qk_norm:
                    c.weight_params += d
            if cfg.qk_norm:
                c.weight_params += d
            lin(H * d, h, o_b)
            W = cfg.window(layer)
            if W is None:  # paged, head-major: every cached key of the source layer (new one included)
                attend(H, L, d, d)
                c.cache_read += B * L * 2 * K * d
                c.cache_copy += 2 * B * L * 2 * K * d  # BatchContext: pool[:, table] gathers a copy
            else:  # a ring of min(W, max_len) slots plus the new token
                R = min(W, max_len)
                attend(H, R + 1, d, d)
                c.cache_read += B * R * 2 * K * d
                c.cache_copy += 2 * B * R * 2 * K * d + 2 * B * (R + 1) * 2 * K * d  # index_select, cat
        elif kind == "mla":
            dc, dr, dn, dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
            fold_q, fold_o = mla_folds(cfg)
            if cfg.is_kv_writer(layer):
                lin(h, dc + dr, qkv_b)  # kv_a: the latent and the RoPE key of the new token
                if cfg.mla_latent_norm:
                    c.weight_params += dc
            if cfg.qk_norm:
                lin(h, H * d, qkv_b)  # q_proj, then q_norm and the per-head map (W_UK folded in or not)
                c.weight_params += d
                width = dc + dr if fold_q else dn + dr
                c.flops += 2 * B * H * d * width
                c.weight_params += H * width * d
                if not fold_q:
                    c.flops += 2 * B * H * dn * dc  # q_lat = W_UK^T q_nope
                    c.weight_params += H * dn * dc
            elif fold_q:
                lin(h, H * (dc + dr), qkv_b)  # q_proj with W_UK folded in
            else:
                lin(h, H * (dn + dr), qkv_b)
                c.flops += 2 * B * H * dn * dc  # q_lat = W_UK^T q_nope
                c.weight_params += H * dn * dc
            attend(H, L, dc + dr, dc)  # one key/value head of width d_c + d_rope over the latents
            c.cache_read += B * L * (dc + dr)
            c.cache_copy += 2 * B * L * (dc + dr)
            if fold_o:
                lin(H * dc, h, o_b)  # o_proj with W_UV folded in
            else:
                c.flops += 2 * B * H * dc * dv  # y = W_UV y_lat
                c.weight_params += H * dv * dc
                lin(H * dv, h, o_b)
            if qkv_b:
                c.weight_params += H * (dn + dv)  # kv_b's bias
        elif kind == "ced":
            dc, dr, dn, dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
            if cfg.index_topk:
                raise NotImplementedError("the indexer's cost is not modelled")
            m = cfg.compress_rate
            lin(h, H * (dn + dr), qkv_b)
            lin(h, K * (dn + dr), qkv_b)  # the layer's own window keys and values
            lin(h, K * dv, qkv_b)
            lin(H * dv, h, o_b)
            src = cfg.kv_source_of(layer)
            if src == layer:  # the compressor writes the shared entry (and its pooling gate)
                lin(h, dc + dr, qkv_b)
                if cfg.mla_latent_norm:
                    c.weight_params += dc
                if m > 1:
                    lin(h, dc + dr)
                    c.weight_params += m * (dc + dr)
            R = ring
            width = K * (dn + dr + dv)
            c.cache_read += B * R * width
            c.cache_copy += 2 * B * R * width + 2 * B * (R + 1) * width  # ring index_select, then cat
            if src is None:
                attend(H, R + 1, dn + dr, dv)
            else:
                N = L // m  # shared entries of the source's segment visible after this step (masked ones too)
                c.flops += 2 * B * H * dn * dc + 2 * B * H * dc * dv  # W_UK into the query, W_UV after
                c.weight_params += H * (dn + dv) * dc + (H * (dn + dv) if qkv_b else 0)
                # one softmax over [window ; latents]: scores over the window keys and the latents
                f = 2 * B * H * ((R + 1) * (dn + dr + dv) + N * (dc + dr + dc))
                c.flops += f
                c.attn_flops += f
                c.score_elems += B * H * (R + 1 + N)
                c.cache_read += B * N * (dc + dr)
                if src not in copied_segments:  # the segment is gathered once per step per source
                    copied_segments.add(src)
                    c.cache_copy += 2 * B * N * (dc + dr)
        else:
            raise ValueError(f"unknown attention kind {kind!r}")
    c.weight_params += h  # final norm
    lin(h, cfg.vocab_size)  # lm_head (tied: the embedding matrix itself)
    if not cfg.tie_word_embeddings:
        c.weight_params += B * h  # the new tokens' embedding rows
    c.cache_stored = cfg.kv_cache_bytes(context, 1)
    return c


# ---- tables ----------------------------------------------------------------------------------------------
def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f}" if n >= 1e7 else f"{n / 1e6:,.1f}"


def analytic_table(
    shape: str, contexts, batches, itemsize: int, window: int, compress_rate: int, layers: int | None = None
) -> tuple[str, list[dict]]:
    cfgs = configs(shape, layers, window, compress_rate)
    g = cfgs["gqa"]
    m, e = cfgs["mla"], cfgs["ced"]
    head = (
        f"shape {shape}: {g.num_layers} layers, hidden {g.hidden_size}, {g.num_heads}q/{g.num_kv_heads}kv x "
        f"{g.head_dim}; MLA d_c {m.kv_lora_rank} + d_rope {m.qk_rope_head_dim} (folds q/o: "
        f"{'/'.join('yes' if f else 'no' for f in mla_folds(m))}); CED window {e.sliding_window} x "
        f"{e.num_kv_heads} heads, m = {e.compress_rate}, kv_source {e.kv_source_layers}; {itemsize} bytes/value\n\n"
    )
    lines = [
        "| context | batch | GQA MB | GQA GFLOP | GQA F/B | MLA MB | MLA GFLOP | MLA F/B | CED MB | CED GFLOP "
        "| CED F/B | MLA bytes / GQA | MLA FLOPs / GQA | CED bytes / GQA | CED FLOPs / GQA |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for S in contexts:
        for B in batches:
            cost = {k: step_cost(cfgs[k], S, B, itemsize) for k in KINDS}
            rows.append(
                {
                    "shape": shape,
                    "context": S,
                    "batch": B,
                    **{
                        k: {**asdict(v), "bytes": v.bytes, "runtime_bytes": v.runtime_bytes, "intensity": v.intensity}
                        for k, v in cost.items()
                    },
                }
            )
            cells = []
            for k in KINDS:
                cells += [_mb(cost[k].bytes), f"{cost[k].flops / 1e9:,.2f}", f"{cost[k].intensity:,.1f}"]
            gq = cost["gqa"]
            cells += [
                f"{cost['mla'].bytes / gq.bytes:.2f}",
                f"{cost['mla'].flops / gq.flops:.2f}",
                f"{cost['ced'].bytes / gq.bytes:.2f}",
                f"{cost['ced'].flops / gq.flops:.2f}",
            ]
            lines.append(f"| {S} | {B} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n", rows


# ---- measurement -----------------------------------------------------------------------------------------
def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device="cpu")
    if cfg.tie_word_embeddings:  # to_empty unties shared parameters: tie them again
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = type(model.rotary)(model.config)
    model.init_weights(seed)
    return model.eval()


def prefilled_cache(model: Transformer, batch: int, context: int, max_len: int, seed: int = 0):
    """A paged cache of ``batch`` sequences already holding ``context`` tokens of random KV (no prefill run)."""
    cache = model.new_cache(batch, max_len)
    for s in cache.sequences:
        cache.extend(s, context)
        cache.commit(s, context)
    gen = torch.Generator().manual_seed(seed)
    for pools in (cache.paged, cache.segments, cache.rings, cache.pending):
        for t in pools.values():
            t.copy_(torch.empty(t.shape).uniform_(-1, 1, generator=gen).to(t.dtype))
    return cache


def roofline_rates(threads: int) -> tuple[float, float]:
    """(peak fp32 matmul FLOP/s, read bandwidth bytes/s) measured here: best of a few runs each."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    torch.mm(a, b)
    best = min(_time(lambda: torch.mm(a, b)) for _ in range(10))
    peak = 2 * 1024**3 / best
    x = torch.ones(64 * 2**20)  # 256 MB
    x.sum()
    bw = x.numel() * 4 / min(_time(x.sum) for _ in range(5))
    return peak, bw


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@contextmanager
def patched(patches: list[tuple[object, str, object]]):
    """Temporarily set ``setattr(owner, name, value)`` for each patch (the "before" code of a variant)."""
    saved = [(o, n, getattr(o, n)) for o, n, _ in patches]
    try:
        for o, n, v in patches:
            setattr(o, n, v)
        yield
    finally:
        for o, n, v in saved:
            setattr(o, n, v)


def before_patches(rev: str) -> list[tuple[object, str, object]]:
    """The decode kernels of git revision ``rev`` (attention_ops.py, latent.py's absorbed attention) as
    patches onto the current code, so "before" and "after" run side by side in one process."""
    import importlib.util
    import subprocess
    import tempfile

    import kvgraft.model.mla as mla_mod
    import kvgraft.model.transformer as tr_mod
    from kvgraft.model.latent import LatentAttention

    root = Path(__file__).resolve().parents[1]
    mods = {}
    for name in ("attention_ops", "latent"):
        text = subprocess.run(
            ["git", "show", f"{rev}:src/kvgraft/model/{name}.py"], cwd=root, check=True, capture_output=True, text=True
        ).stdout
        path = Path(tempfile.mkdtemp()) / f"before_{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"before_{name}", path)
        mods[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[name])
    ops = mods["attention_ops"]
    return [
        (tr_mod, "grouped_attention", ops.grouped_attention),
        (tr_mod, "grouped_attention_head_major", ops.grouped_attention_head_major),
        (mla_mod, "grouped_attention", ops.grouped_attention),
        (LatentAttention, "_attend_absorbed", mods["latent"].LatentAttention._attend_absorbed),
    ]


@torch.inference_mode()
def measure(runs: dict[str, tuple[Transformer, list]], context: int, batch: int, steps: int, warmup: int) -> dict[str, float]:
    """Median ms per decode step of each run (a model and the patches it runs under), interleaved step by
    step in a rotating order; each run has its own cache."""
    names = list(runs)
    max_len = context + warmup + steps + 1
    caches = {n: prefilled_cache(runs[n][0], batch, context, max_len) for n in names}
    ids = torch.zeros(batch, 1, dtype=torch.long)
    times: dict[str, list[float]] = {n: [] for n in names}
    for step in range(warmup + steps):
        k = step % len(names)
        for n in names[k:] + names[:k]:
            model, patches = runs[n]
            with patched(patches):
                t0 = time.perf_counter()
                model(ids, cache=caches[n], last_only=True)
                dt = time.perf_counter() - t0
            if step >= warmup:
                times[n].append(dt)
    del caches
    return {n: statistics.median(t) * 1e3 for n, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--analytic-contexts", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768])
    ap.add_argument("--analytic-batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--analytic-bytes", type=int, default=2, help="bytes per value of the analytic tables (2: bf16)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the timed models (1B shape)")
    ap.add_argument("--window", type=int, default=128, help="CED sliding window (1B shape)")
    ap.add_argument("--compress-rate", type=int, default=2, help="CED pooling rate m (1B shape)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--analytic-only", action="store_true")
    ap.add_argument(
        "--before",
        default=None,
        metavar="GITREV",
        help="also time the decode kernels of this git revision (attention_ops.py, latent.py), side by side",
    )
    ap.add_argument("--before-kinds", nargs="+", default=["gqa", "mla"], choices=KINDS)
    ap.add_argument("--no-roofline", action="store_true")
    ap.add_argument("--out", default="runs/bench/decode_cost.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {"args": vars(args)}

    for shape in ("1b", "8m"):
        text, rows = analytic_table(
            shape, args.analytic_contexts, args.analytic_batches, args.analytic_bytes, args.window, args.compress_rate
        )
        print(
            f"## analytic, per decode step: MB = weights + cache read (ideal), GFLOP = matmul FLOPs, "
            f"F/B = FLOPs per byte\n\n{text}"
        )
        result[f"analytic_{shape}"] = rows
    if args.analytic_only:
        return _write(args.out, result)

    cfgs = configs("1b", args.layers, args.window, args.compress_rate)
    cfgs = {k: cfgs[k] for k in args.kinds}
    peak = bw = None
    load = [Path("/proc/loadavg").read_text().split()[:3]] if Path("/proc/loadavg").exists() else []
    if not args.no_roofline:
        peak, bw = roofline_rates(args.threads)
        print(
            f"this machine, {args.threads} threads: fp32 matmul {peak / 1e9:.0f} GFLOP/s, read {bw / 1e9:.1f} GB/s "
            f"(ridge {peak / bw:.1f} FLOP/B)\n"
        )
    models = {k: build(c) for k, c in cfgs.items()}
    runs = {k: (m, []) for k, m in models.items()}
    if args.before:
        patches = before_patches(args.before)
        for k in args.before_kinds:
            if k in models:
                runs[f"{k}@{args.before}"] = (models[k], patches)
    print(
        f"## measured, CPU fp32, {args.threads} threads, {args.layers} layers of shape 1b, median of {args.steps} "
        f"steps (ms per step; ratio = GQA time / this time, >1 is faster)\n"
    )
    hdr = "| context | batch | " + " | ".join(
        f"{k.upper()} ms | {k.upper()} GFLOP | {k.upper()} MB | {k.upper()} roofline ms" for k in cfgs
    )
    extra = [n for n in runs if n not in cfgs]
    hdr += "".join(f" | {n} ms" for n in extra)
    hdr += " | " + " | ".join(f"{k.upper()} vs GQA" for k in cfgs if k != "gqa")
    hdr += "".join(f" | {n.split('@')[0].upper()} before/after" for n in extra) + " |"
    print(hdr)
    print("|" + "---:|" * (hdr.count("|") - 1))
    measured = []
    for S in args.contexts:
        for B in args.batches:
            ms = measure(runs, S, B, args.steps, args.warmup)
            cells, row = [], {"context": S, "batch": B}
            for k, cfg in cfgs.items():
                cost = step_cost(cfg, S, B, 4, S + args.warmup + args.steps + 1)
                roof = max(cost.flops / peak, cost.bytes / bw) * 1e3 if peak else float("nan")
                cells += [f"{ms[k]:.1f}", f"{cost.flops / 1e9:.2f}", _mb(cost.bytes), f"{roof:.1f}"]
                row[k] = {
                    "ms": ms[k],
                    "flops": cost.flops,
                    "bytes": cost.bytes,
                    "runtime_bytes": cost.runtime_bytes,
                    "roofline_ms": roof,
                }
            cells += [f"{ms[n]:.1f}" for n in extra]
            if "gqa" in ms:
                cells += [f"{ms['gqa'] / ms[k]:.2f}x" for k in cfgs if k != "gqa"]
            cells += [f"{ms[n] / ms[n.split('@')[0]]:.2f}x" for n in extra]
            row.update({n: {"ms": ms[n]} for n in extra})
            print(f"| {S} | {B} | " + " | ".join(cells) + " |", flush=True)
            measured.append(row)
    if Path("/proc/loadavg").exists():
        load.append(Path("/proc/loadavg").read_text().split()[:3])
        print(f"\nload average (1, 5, 15 min) at the start / end of the timing: {load[0]} / {load[-1]}")
    result["measured"] = measured
    result["machine"] = {"threads": args.threads, "peak_flops": peak, "read_bw": bw, "loadavg": load}
    _write(args.out, result)


def _write(path: str, result: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result, indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
