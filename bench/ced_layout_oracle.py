"""Which causal encoder-decoder layouts can copy from beyond their window, before any compression?

The share graft changes two things at once: where a layer's distant keys and values come from (the hidden state
entering its kv_source layer instead of its own) and how they are stored (a d_c latent plus one shared RoPE key).
This script removes the second: every layer reads its window with its own keys and values, and everything older
through *its own* ``k_proj``/``v_proj`` (and input norm, and exact per-head RoPE) applied to the hidden state
entering the nearest kv_source layer at or before it (layers before the first source read only their window). One
softmax over both, as in ``kvgraft.model.ced``. What it measures is the best any compression of a layout can do, so
a layout that cannot copy here cannot copy after conversion either, whatever the rank.

    .venv/bin/python bench/ced_layout_oracle.py --layouts 2,6,10,15 2,6,10,15,20,25 --window 128

Prints, per layout, the loss on the second reading of a held-out passage read twice (``bench/real_ced_copy.py``'s
protocol) and the held-out perplexity of the manual's first windows; SmolLM2 itself is the first row (every layer
its own source).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from real_ced_copy import copy_losses  # this script's folder is on sys.path
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvgraft.reference import resolve_model

ROOT = Path(__file__).resolve().parents[1]


def parse_layout(text: str, layers: int) -> tuple[int, ...]:
    """'2,6,10,15' -> (2, 6, 10, 15), strictly increasing, inside [0, layers); 'all' -> every layer."""
    if text == "all":
        return tuple(range(layers))
    try:
        out = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise SystemExit(f"layout {text!r}: expected comma-separated layer indices such as 2,6,10,15, or 'all'") from None
    if not out or any(b <= a for a, b in zip(out, out[1:])) or out[0] < 0 or out[-1] >= layers:
        raise SystemExit(f"layout {text!r}: layers must be strictly increasing within 0..{layers - 1}")
    return out


@torch.no_grad()
def oracle_logits(model, ids: torch.Tensor, sources: tuple[int, ...], window: int) -> torch.Tensor:
    """(1, T) ids -> (T, vocab) logits of ``model`` run with the layout's read pattern, keys uncompressed."""
    m = model.model
    cfg = model.config
    t = ids.shape[1]
    h = m.embed_tokens(ids)
    pos = torch.arange(t)[None]
    cos, sin = m.rotary_emb(h, pos)
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    own = (j <= i) & (i - j < window)
    far = i - j >= window
    nh, nk, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rep = nh // nk
    source_in = None
    for idx, layer in enumerate(m.layers):
        if idx in sources:
            source_in = h
        att = layer.self_attn
        a = layer.input_layernorm(h)
        q = att.q_proj(a).view(1, t, nh, hd).transpose(1, 2)
        k = att.k_proj(a).view(1, t, nk, hd).transpose(1, 2)
        v = att.v_proj(a).view(1, t, nk, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        if source_in is None:
            scores = scores.masked_fill(~own, float("-inf"))
            out = scores.softmax(-1) @ v
        else:
            s = layer.input_layernorm(source_in)
            kf = att.k_proj(s).view(1, t, nk, hd).transpose(1, 2)
            vf = att.v_proj(s).view(1, t, nk, hd).transpose(1, 2)
            _, kf = apply_rotary_pos_emb(q, kf, cos, sin)
            kf, vf = kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1)
            sf = (q @ kf.transpose(-1, -2)) / math.sqrt(hd)
            scores = torch.where(own, scores, torch.where(far, sf, torch.full_like(sf, float("-inf"))))
            p = scores.softmax(-1)
            out = (p * own) @ v + (p * far) @ vf
        h = h + att.o_proj(out.transpose(1, 2).reshape(1, t, nh * hd))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(m.norm(h))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a Llama-family model name or directory")
    ap.add_argument("--layouts", nargs="+", required=True, help="kv_source layers, comma-separated (last = pivot)")
    ap.add_argument("--window", type=int, default=128, help="every layer's window (tokens, >= 1)")
    ap.add_argument("--length", type=int, default=300, help="passage length L (tokens, > --window to test the stream)")
    ap.add_argument("--passages", type=int, default=6, help="passages read twice (>= 1)")
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="held-out tokens scored in 512-token windows")
    ap.add_argument("--texts", type=Path, default=ROOT / "runs" / "real-texts", help="bench/real_texts.py's output")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.window < 1 or args.length < 2 or args.passages < 1 or args.ppl_tokens < 512:
        raise SystemExit("--window >= 1, --length >= 2, --passages >= 1 and --ppl-tokens >= 512 are required")
    path = args.texts / "manual.npy"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `python bench/real_texts.py` first")
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32).eval()
    n_layers = model.config.num_hidden_layers
    layouts = [("model itself", tuple(range(n_layers)), 10**9)]
    layouts += [(text, parse_layout(text, n_layers), args.window) for text in args.layouts]
    tokens = np.load(path)
    need = 1000 + args.passages * 400 + args.length + args.ppl_tokens
    if tokens.size < need:
        raise SystemExit(f"{path} has {tokens.size} tokens; these --passages/--length/--ppl-tokens need {need}")
    rows = []
    for name, sources, window in layouts:
        t0 = time.perf_counter()

        def run(x: torch.Tensor, sources: tuple[int, ...] = sources, window: int = window) -> torch.Tensor:
            return oracle_logits(model, x, sources, window)[None]  # (1, T, vocab), as a model's forward

        _, second = copy_losses(run, tokens, args.length, args.passages)  # bench/real_ced_copy.py's protocol
        nlls = []
        start = 1000 + args.passages * 400 + args.length  # past the copy passages
        for s in range(start, start + args.ppl_tokens, 512):
            x = torch.tensor([tokens[s : s + 512].tolist()])
            logits = oracle_logits(model, x, sources, window)
            nlls.append(F.cross_entropy(logits[:-1], x[0, 1:]).item())
        row = {
            "layout": name,
            "sources": list(sources),
            "window": args.window,
            "length": args.length,
            "second_copy": second,
            "perplexity": math.exp(float(np.mean(nlls))),
        }
        rows.append(row)
        print(
            f"{name:28s} second copy at L {args.length}: {row['second_copy']:.3f} nats, "
            f"perplexity {row['perplexity']:.2f} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
