"""``kvgraft pretrain``, ``kvgraft heal`` and ``kvgraft ship``: their arguments (run by :mod:`kvgraft.cli.cmd.train`;
the training options are ``TrainConfig``'s fields)."""

from __future__ import annotations

from kvgraft.cli.args.common import Subparsers, add_train_args, preset_name
from kvgraft.train.config import TrainConfig


def add_pretrain(sub: Subparsers) -> None:
    p = sub.add_parser("pretrain", help="pretrain a model from scratch on prepared data (resumable)")
    p.add_argument("--data", required=True, help="directory made by `kvgraft prepare-data`")
    p.add_argument("--out", required=True, help="run directory; rerun the same command to resume")
    p.add_argument(
        "--model",
        default="llama-8m",
        type=preset_name,
        help="model preset, a name in kvgraft.model.presets.PRESETS (default: llama-8m)",
    )
    p.add_argument("--seq-len", type=int, default=None, help="training sequence length (default: model context)")
    add_train_args(p, TrainConfig(max_steps=1000))
    p.set_defaults(func="train:pretrain")


def add_heal(sub: Subparsers) -> None:
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
        "--copy-fraction",
        type=float,
        default=0.0,
        help="share of the training windows that repeat their first --copy-span tokens (0-1, default 0): distilled "
        "from a teacher that copies, the student learns to copy from that far back (a causal encoder-decoder through "
        "its shared stream when the span exceeds its windows)",
    )
    p.add_argument("--copy-span", type=int, default=None, help="tokens a copy window repeats (default: half of --seq-len)")
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
    add_train_args(p, heal_defaults)
    p.set_defaults(func="train:heal", lr=None)  # default LR: 1/10 of the original's


def add_ship(sub: Subparsers) -> None:
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
