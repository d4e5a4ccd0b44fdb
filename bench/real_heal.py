"""Healing the real model's grafts by KL distillation on a CPU budget, resumable across machines.

    .venv/bin/python bench/real_heal.py run --hours 1.5      # convert if needed, resume, heal, pack, plot
    .venv/bin/python bench/real_heal.py score                # held-out texts on the latest checkpoint
    .venv/bin/python bench/real_heal.py plot                 # the curve alone (bench/real_heal.png)
    .venv/bin/python bench/real_heal.py run --student ced    # the same for the causal encoder-decoder
    .venv/bin/python bench/real_heal.py build --student ced  # the healed model from the committed pack, no training

Two students (``--student``, each with its own model and run directories, pack and plot):

- ``mla`` (default): ``kvgraft convert smollm2-135m-instruct --format both`` with every default (4x, 64 + 32,
  the graft's latent norm, 4 epochs of refinement, kvgraft's calibration text); packed in ``bench/real_heal/``.
- ``ced``: the causal encoder-decoder of ``CED_CONVERT`` (the layout chosen by ``bench/real_ced_layouts.py``);
  packed in ``bench/real_ced/``, plotted in ``bench/real_ced.png``.

The teacher is SmolLM2 itself; the data
is ``kvgraft prepare-data --out runs/smol-data --sources kjv web python-docs fortunes`` (5.31M training tokens,
the held-out texts of bench/real_texts.py excluded). The run is ``kvgraft heal`` with the student's recipe (``RECIPE``:
attention only, KL, 512-token sequences, 8,192 tokens a step, cosine over a 5M-token budget; ``CED_RECIPE``: the
same with half the windows copy windows, 4,096 tokens a step, cosine over 700K tokens), stopped after
``--hours`` by its own ``--max-time-s`` (a checkpoint is written on the way out, and on SIGTERM).

What lasts across machines is committed in the student's pack directory: the latest checkpoint's trainable weights (the
attention, int8 in groups of 64 with fp16 scales, in shards under 40 MB), its state, the run's config and log. On a
fresh machine ``run`` rebuilds the student by converting again, unpacks the committed checkpoint (weights as packed,
AdamW's moments restarted: the one step where the resumed run differs from an uninterrupted one, recorded in the log)
and goes on. The curve is the run's validation perplexity (the data's held-out split, 16,384 tokens, bf16
autocast as in training) against training tokens, beside the teacher's on the same tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvgraft.atomic import atomic_dir, atomic_savefig, atomic_write_json
from kvgraft.data import PackedDataset
from kvgraft.hf import load_pretrained
from kvgraft.reference import resolve_model
from kvgraft.train.checkpoint import PREFIX, find_latest
from kvgraft.train.loop import evaluate, lm_loss

ROOT = Path(__file__).resolve().parents[1]
TEACHER = "smollm2-135m-instruct"
# the causal encoder-decoder's conversion: writers every fourth layer up to a pivot at 18 (bench/RESULTS.md, "Which
# layouts can copy at all?": the seed's 2, 6, 10, 15 cannot copy beyond its window even uncompressed, because
# SmolLM2's layer 18 reads what layer 17 writes; a pivot at 18 keeps it)
CED_CONVERT = [
    "--to", "ced", "--kv-source-layers", "2", "6", "10", "14", "18", "--sliding-window", "128", "--kv-lora-rank", "320",
    "--rope-dim", "64",
]  # fmt: skip
STUDENTS = {
    "mla": {
        "convert": ["--format", "both"],
        "recipe": "RECIPE",
        "pack": ROOT / "bench" / "real_heal",
        "dir": ROOT / "runs" / "real-heal",
        "png": ROOT / "bench" / "real_heal.png",
        "label": "4x MLA graft",
    },
    "ced": {
        "convert": CED_CONVERT,
        "recipe": "CED_RECIPE",
        "pack": ROOT / "bench" / "real_ced",
        "dir": ROOT / "runs" / "real-ced",
        "png": ROOT / "bench" / "real_ced.png",
        "label": "causal encoder-decoder graft",
    },
}
PACK = STUDENTS["mla"]["pack"]  # the chosen student's (main() sets it)
STUDENT_LABEL = STUDENTS["mla"]["label"]
SHARD_BYTES = 35 * 2**20  # under the repository's 40 MB a file
RECIPE = [
    "--loss", "kl", "--attention-only", "--tokens", "5000000", "--seq-len", "512", "--micro-batch-size", "4",
    "--grad-accum", "4", "--lr", "2e-4", "--warmup-steps", "20", "--eval-every", "10", "--eval-batches", "8",
    "--save-every", "25", "--keep-checkpoints", "2", "--log-every", "1",
]  # fmt: skip
# the encoder-decoder's: half the windows repeat their first 256 tokens (beyond its 128-token window, so the copy
# is read through the shared stream: distilled copying), 4,096 tokens a step, cosine to 0.1x over 700K tokens
CED_RECIPE = [
    "--loss", "kl", "--attention-only", "--copy-fraction", "0.5", "--tokens", "700000", "--seq-len", "512",
    "--micro-batch-size", "4", "--grad-accum", "2", "--lr", "2e-4", "--warmup-steps", "10", "--eval-every", "10",
    "--eval-batches", "8", "--save-every", "10", "--keep-checkpoints", "2", "--log-every", "1",
]  # fmt: skip
RECIPES = {"RECIPE": RECIPE, "CED_RECIPE": CED_RECIPE}
TEXTS = ("manual", "glossary")
# packed 2-D weights: int8 in groups of GROUP input columns, each group with its own fp16 scale (absmax / 127); a
# weight's error is at most half a step of its group, about 0.4% of the group's largest entry
GROUP = 64
SCALE = ".int8_scale"


def quantize(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """One trainable tensor as packed: 2-D weights whose width GROUP divides as int8 plus scales, others in fp32."""
    if t.dim() != 2 or t.shape[1] % GROUP:
        return {name: t.float().contiguous()}
    g = t.float().reshape(t.shape[0], t.shape[1] // GROUP, GROUP)
    scale = (g.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(1e-12).half()
    q = torch.round(g / scale.float()).clamp(-127, 127).to(torch.int8)
    return {name: q.reshape(t.shape).contiguous(), name + SCALE: scale.squeeze(-1).contiguous()}


def load_pack(src: Path) -> dict[str, torch.Tensor]:
    """The packed trainable weights in fp32 (int8 groups with their scales, or the bf16 shards of older packs)."""
    raw: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("attention-*.safetensors")):
        raw.update(load_file(str(shard)))
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(SCALE):
            continue
        if t.dtype == torch.int8:
            scale = raw[name + SCALE].float().unsqueeze(-1)
            t = (t.float().reshape(t.shape[0], -1, GROUP) * scale).reshape(t.shape)
        out[name] = t.float()
    return out


def convert(model: Path, args: list[str]) -> None:
    if (model / "conversion.json").is_file():
        return
    cmd = [sys.executable, "-m", "kvgraft", "convert", TEACHER, *args, "--out", str(model)]
    print("converting:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)


def pack(run: Path) -> Path | None:
    """The run's latest checkpoint -> the pack directory (int8 shards, state, config, log), atomically."""
    latest = find_latest(run)
    if latest is None:
        return None
    state = json.loads((latest / "state.json").read_text())
    if not state.get("trainable_only"):
        raise SystemExit(f"{latest} holds the whole model; an attention-only heal checkpoints only what trains")
    weights = load_file(str(latest / "model.safetensors"))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(weights):
        packed = quantize(name, weights[name])
        nbytes = sum(t.numel() * t.element_size() for t in packed.values())
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1].update(packed)
        size += nbytes
    with atomic_dir(PACK / "checkpoint", overwrite=True) as tmp:
        for i, shard in enumerate(shards):
            save_file(shard, str(tmp / f"attention-{i:02d}.safetensors"))
        source = Path(state.get("source", ""))
        if source.is_absolute() and source.is_relative_to(ROOT):  # no path of this machine in the repository
            state["source"] = str(source.relative_to(ROOT))
        (tmp / "state.json").write_text(json.dumps({**state, "packed_from": latest.name}, indent=2) + "\n")
        shutil.copy(run / "train_config.json", tmp / "train_config.json")
        shutil.copy(run / "log.jsonl", tmp / "log.jsonl")
    print(f"packed {latest.name} ({len(shards)} shards) into {PACK / 'checkpoint'}", flush=True)
    return PACK / "checkpoint"


def unpack(run: Path) -> None:
    """The committed checkpoint -> the run directory, when the run has no checkpoint as far along."""
    src = PACK / "checkpoint"
    if not (src / "state.json").is_file():
        return
    state = json.loads((src / "state.json").read_text())
    latest = find_latest(run)
    if latest is not None and json.loads((latest / "state.json").read_text())["step"] >= state["step"]:
        return
    weights = load_pack(src)
    target = run / "checkpoints" / f"{PREFIX}{state['step']:08d}"
    run.mkdir(parents=True, exist_ok=True)
    with atomic_dir(target, overwrite=True) as tmp:
        save_file(weights, str(tmp / "model.safetensors"))
        state = {
            **state,
            "optimizer_reset": f"unpacked from {PACK.relative_to(ROOT)}: weights as packed (int8 groups), AdamW moments restarted",
        }
        (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
    shutil.copy(src / "train_config.json", run / "train_config.json")
    shutil.copy(src / "log.jsonl", run / "log.jsonl")
    print(f"unpacked step {state['step']} ({state['tokens']:,} tokens) into {target}", flush=True)


def build(model: Path, args: list[str], out: Path) -> None:
    """A fresh clone's healed student without training: convert, then the committed checkpoint's trainable
    weights (as packed) over it, written as a complete kvgraft checkpoint at ``out`` (atomically)."""
    from kvgraft.hf.save import save_pretrained

    src = PACK / "checkpoint"
    if not (src / "state.json").is_file():
        raise SystemExit(f"{src} holds no packed checkpoint: run `run` first")
    convert(model, args)
    student = load_pretrained(model, dtype=torch.float32)
    params = dict(student.named_parameters())
    with torch.no_grad():
        for name, t in load_pack(src).items():
            if name not in params:
                raise SystemExit(f"{src} holds {name}, which the converted model has not: was it converted otherwise?")
            params[name].copy_(t)
    state = json.loads((src / "state.json").read_text())
    card = (
        f"# {STUDENT_LABEL}, healed\n\nBuilt by `bench/real_heal.py build`: `kvgraft convert {TEACHER} {' '.join(args)}`, "
        f"then the attention weights of `{PACK.relative_to(ROOT)}/checkpoint` (step {state['step']}, "
        f"{state['tokens']:,} tokens of KL healing from {TEACHER}; as packed, int8 groups of {GROUP}). The card of the run: "
        f"`{PACK.relative_to(ROOT)}/README.md`.\n"
    )
    with atomic_dir(out, overwrite=True) as tmp:
        save_pretrained(student, tmp, tokenizer_dir=model, model_type="kvgraft", overwrite=True, extra_files={"README.md": card})
    print(f"built {out} (step {state['step']}, {state['tokens']:,} tokens)", flush=True)


def val_loss(name: str, model: Path, data: Path, threads: int) -> float:
    """A model's validation loss on the batches the run validates on (cached in bench/real_heal/NAME.json):
    the teacher's, and the student's before healing (the curve's point at 0 tokens)."""
    path = PACK / f"{name}.json"
    PACK.mkdir(parents=True, exist_ok=True)
    if path.is_file():
        return json.loads(path.read_text())["val_loss"]
    torch.set_num_threads(threads)
    net = load_pretrained(model, dtype=torch.float32)
    val = PackedDataset(data / "tokens" / "validation.npy", 512)
    with torch.no_grad():
        loss = evaluate(net, val, lm_loss, batch_size=4, max_batches=8, precision="bf16")
    atomic_write_json(path, {"val_loss": loss, "val_ppl": math.exp(loss), "batches": "8 x 4 x 512, bf16 autocast"})
    return loss


def plot(model: Path, data: Path, threads: int, png: Path, label: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = PACK / "checkpoint" / "log.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    points = [(r["tokens"], r["val_ppl"]) for r in rows if "val_ppl" in r]
    teacher = math.exp(val_loss("teacher", resolve_model(TEACHER), data, threads))
    points = [(0, math.exp(val_loss("student-oneshot", model, data, threads))), *points]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    if points:
        ax.plot([t / 1e6 for t, _ in points], [p for _, p in points], marker="o", label=f"{label}, healing (KL)")
    ax.axhline(teacher, color="k", linestyle="--", label=f"SmolLM2-135M-Instruct ({teacher:.2f})")
    ax.axhline(teacher * 1.05, color="gray", linestyle=":", label="within 5%")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("validation perplexity")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())  # plain numbers, not 2 x 10^1
    ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_title(f"Healing SmolLM2-135M's {label} (2 CPU cores)")
    ax.legend()
    fig.tight_layout()
    atomic_savefig(fig, png)
    lines = ["| tokens | validation ppl | x teacher |", "|---|---|---|"]
    lines += [f"| {t:,} | {p:.2f} | {p / teacher:.3f}x |" for t, p in points]
    print("\n".join(lines))


def score(run: Path, model: Path, texts: Path, threads: int) -> None:
    """Held-out texts (never calibrated on, never trained on) for the latest checkpoint."""
    import numpy as np

    from kvgraft.eval.perplexity import perplexity

    torch.set_num_threads(threads)
    latest = find_latest(run)
    if latest is None:
        raise SystemExit(f"no checkpoint in {run}")
    student = load_pretrained(model, dtype=torch.float32)
    params = dict(student.named_parameters())
    with torch.no_grad():
        for name, t in load_file(str(latest / "model.safetensors")).items():
            params[name].copy_(t)
    state = json.loads((latest / "state.json").read_text())
    out = {"step": state["step"], "tokens": state["tokens"], "ppl": {}}
    with torch.no_grad():
        for name in TEXTS:
            out["ppl"][name] = perplexity(student, np.load(texts / f"{name}.npy"), seq_len=512).ppl
    path = PACK / "heldout.json"
    records = json.loads(path.read_text()) if path.is_file() else []
    records = [r for r in records if r["step"] != out["step"]] + [out]
    atomic_write_json(path, sorted(records, key=lambda r: r["step"]))
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["run", "build", "score", "plot", "pack"])
    p.add_argument("--student", choices=sorted(STUDENTS), default="mla", help="which graft heals (see above)")
    p.add_argument("--hours", type=float, default=1.0, help="stop the heal after this long (it checkpoints)")
    p.add_argument(
        "--model", type=Path, default=None, help="the converted student (default: runs/real-heal/model, runs/real-ced/model)"
    )
    p.add_argument("--run", type=Path, default=None, help="the heal's run directory (default: beside the model)")
    p.add_argument(
        "--out", type=Path, default=None, help="build: where the healed model goes (default: beside the model, healed)"
    )
    p.add_argument("--data", type=Path, default=ROOT / "runs" / "smol-data")
    p.add_argument("--texts", type=Path, default=ROOT / "runs" / "real-texts")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if not math.isfinite(a.hours) or a.hours <= 0:
        raise SystemExit(f"--hours ({a.hours}) must be a positive number")
    global PACK, STUDENT_LABEL
    student = STUDENTS[a.student]
    PACK, STUDENT_LABEL = student["pack"], student["label"]
    a.model = a.model or student["dir"] / "model"
    a.run = a.run or student["dir"] / "run"
    if a.what == "run":
        if not (a.data / "tokens" / "train.npy").is_file():
            raise SystemExit(f"{a.data} has no tokens; see this script's docstring for the prepare-data command")
        convert(a.model, student["convert"])
        unpack(a.run)
        val_loss("teacher", resolve_model(TEACHER), a.data, a.threads)
        cmd = [sys.executable, "-m", "kvgraft", "heal", str(a.model), "--out", str(a.run), "--data", str(a.data)]
        cmd += ["--teacher", TEACHER, *RECIPES[student["recipe"]], "--max-time-s", str(int(a.hours * 3600)), "--no-progress"]
        print("healing:", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})
        pack(a.run)
        plot(a.model, a.data, a.threads, student["png"], student["label"])
    elif a.what == "build":
        build(a.model, student["convert"], a.out or student["dir"] / "healed")
    elif a.what == "pack":
        pack(a.run)
    elif a.what == "plot":
        plot(a.model, a.data, a.threads, student["png"], student["label"])
    else:
        score(a.run, a.model, a.texts, a.threads)


if __name__ == "__main__":
    main()
