"""Variants of the engine-safe latent norm on the reference model's one-shot graft (bench/RESULTS.md, P1).

    .venv/bin/python bench/engine_latent_variants.py [COMPRESSION] [EVAL_TOKENS]    # defaults 4, 16384

Stock DeepSeek-V3 always RMS-normalises the latent; with no attention bias (what vLLM/SGLang load) the export
cannot pin that norm exactly. Each variant builds a kvgraft model with its own latent norm (exported exactly
by ``export_deepseek_v3``) and scores it on the held-out slice and the Debian-reference text:
  - the exact "pad" construction's function (the graft at d_c - 1 in kvgraft format: what the transformers-only
    export computes),
  - hidden=True: d_c - 1 latent values plus one coordinate on the attention input's most constant direction
    u.x (u = Sigma^-1 mu), the metric fitted over both,
  - hidden=False: the graft at the whole d_c with the fitted metric (``fit_latent_metric``: the default),
  - refit=True: kv_b refitted by least squares on the normalised latents.
"""

import sys
import time

import numpy as np
import torch

from kvgraft.eval import perplexity
from kvgraft.graft.calibration import load_calibration
from kvgraft.graft.mla import GraftConfig, graft_mla
from kvgraft.graft.ranks import default_ranks
from kvgraft.hf import load_pretrained
from kvgraft.hf.deepseek import fit_latent_metric
from kvgraft.model.transformer import Transformer
from kvgraft.reference import resolve_model


def main() -> None:
    torch.set_num_threads(1)
    comp = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    EVAL = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
    path = resolve_model(None)
    orig = load_pretrained(path, dtype=torch.float32)
    calib = load_calibration(path, None, 32768, 512)
    texts = {"in": path / "eval" / "heldout.npy", "ood": "runs/ood/debian-reference.npy"}
    import os

    texts = {k: v for k, v in texts.items() if os.path.exists(v)}

    def score(m):
        return {k: perplexity(m, v, max_tokens=EVAL, progress=False).ppl for k, v in texts.items()}

    base = score(orig)
    print("orig", base, flush=True)
    ranks = default_ranks(orig.config, compression=comp, stock=True, stock_layout="prefix")
    dc, dr = ranks.kv_lora_rank, ranks.qk_rope_head_dim

    def mk(d):
        g = GraftConfig(
            kv_lora_rank=d,
            qk_rope_head_dim=dr,
            objective="attention",
            rope_selection="prefix",
            layerwise=True,
            rope_expectation=True,
            calibration_shrinkage=0.5,
            rope_rotation="complex",
        )
        return graft_mla(orig, g, calib, progress=False)

    @torch.no_grad()
    def collect(m, n=8192):
        d = m.config.kv_lora_rank
        X = [[] for _ in m.layers]
        C = [[] for _ in m.layers]
        hs = []
        for i, b in enumerate(m.layers):

            def hk(mod, inp, out, i=i):
                X[i].append(inp[0].reshape(-1, inp[0].shape[-1]).double())
                C[i].append(out[..., :d].reshape(-1, d).double())

            hs.append(b.self_attn.kv_a_proj.register_forward_hook(hk))
        for s in range(0, calib.shape[0], 8):
            m(calib[s : s + 8])
        for h in hs:
            h.remove()
        return [torch.cat(x)[:: max(1, len(torch.cat(x)) // n)] for x in X], [
            torch.cat(c)[:: max(1, len(torch.cat(c)) // n)] for c in C
        ]

    def sqrtm(G):
        ev, evec = torch.linalg.eigh(G)
        ev = ev.clamp_min(1e-30 * ev.max())
        return (evec * ev.sqrt()) @ evec.T, (evec * ev.rsqrt()) @ evec.T

    @torch.no_grad()
    def normed(m, hidden, refit, eps=1e-6):
        cfg = m.config
        d = cfg.kv_lora_rank
        X, C = collect(m)
        d2 = d + (1 if hidden else 0)
        new = Transformer(cfg.replace(kv_lora_rank=d2, mla_latent_norm=True, rms_norm_eps=cfg.rms_norm_eps))
        sd = {k: v.clone() for k, v in m.state_dict().items()}
        cvs = []
        for i, b in enumerate(m.layers):
            p = f"layers.{i}.self_attn."
            Wa = sd[p + "kv_a_proj.weight"].double()
            Wb = sd[p + "kv_b_proj.weight"].double()
            x, c = X[i], C[i]
            if hidden:
                mu = x.mean(0)
                S = torch.cov(x.T) + 1e-6 * torch.eye(x.shape[1], dtype=torch.float64)
                u = torch.linalg.solve(S, mu)
                a = x @ u
                sc = float(c.pow(2).mean().sqrt() / a.abs().mean()) * 3.0
                u = u * sc
                a = a * sc
                ch = torch.cat([c, a[:, None]], 1)
                Wrows = torch.cat([Wa[:d], u[None]], 0)
                P = torch.cat([torch.eye(d, dtype=torch.float64), torch.zeros(d, 1, dtype=torch.float64)], 1)  # c = P ch
            else:
                ch = c
                Wrows = Wa[:d]
                P = torch.eye(d, dtype=torch.float64)
            G = fit_latent_metric(ch)
            M, Mi = sqrtm(G)
            cp = ch @ M.T
            r = (cp.pow(2).mean(1) + eps).sqrt()
            cvs.append(float(r.std() / r.mean()))
            Y = c @ Wb.T  # targets
            Kb = Wb @ P @ Mi  # kv_b on c' = M ch: Wb c = Wb P Mi c'
            energy = Y.pow(2).sum(1)
            gamma = float((energy / r).sum() / (energy / r**2).sum())
            g = torch.full((d2,), gamma, dtype=torch.float64)
            n = cp / r[:, None] * gamma
            Kfix = Kb
            if refit:
                A = n.T @ n
                A += 1e-6 * A.diagonal().mean() * torch.eye(d2, dtype=torch.float64)
                Kfix = torch.linalg.solve(A, n.T @ Y).T
            sd[p + "kv_a_proj.weight"] = torch.cat([M @ Wrows, Wa[d:]]).float()
            sd[p + "kv_a_norm.weight"] = g.float()
            sd[p + "kv_b_proj.weight"] = Kfix.float()
        new.load_state_dict(sd, strict=True)
        return new, cvs

    for d, hidden in ((dc - 1, True), (dc, False)):
        t = time.time()
        g = mk(d)
        print(f"graft d_c {d} d_rope {dr}: {time.time() - t:.0f}s", flush=True)
        if hidden:
            s = score(g)
            print(
                f"  pad-equivalent (exact, d_c {d}+1): " + " ".join(f"{k} {v:.3f} ({v / base[k]:.4f}x)" for k, v in s.items()),
                flush=True,
            )
        for refit in (False, True):
            nm, cvs = normed(g, hidden, refit)
            s = score(nm)
            print(
                f"  normed hidden={hidden} refit={refit} cv {np.mean(cvs):.4f}: "
                + " ".join(f"{k} {v:.3f} ({v / base[k]:.4f}x)" for k, v in s.items()),
                flush=True,
            )


if __name__ == "__main__":
    main()
