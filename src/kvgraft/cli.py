"""The ``kvgraft`` command: one subcommand per entry-point function, no logic of its own.

User errors (bad paths, bad values, corrupt checkpoints) print one line ``kvgraft: error: ...``
and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvgraft.errors import KvgraftError


def _add_train_args(p: argparse.ArgumentParser, defaults) -> None:
    """Expose every TrainConfig field as --field-name (defaults from the recipe)."""
    from kvgraft.train.config import TrainConfig

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


def _train_config(args: argparse.Namespace):
    from kvgraft.train.config import TrainConfig

    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def cmd_prepare_data(args: argparse.Namespace) -> int:
    from kvgraft.data import prepare_data

    summary = prepare_data(args.out, sources=args.sources, vocab_size=args.vocab_size, seed=args.seed,
                           files=args.files)
    for split, s in summary["splits"].items():
        print(f"{split:>10}: {s['documents']:>6} documents, {s['tokens']:>9,} tokens")
    return 0


def cmd_pretrain(args: argparse.Namespace) -> int:
    from kvgraft.train.pretrain import pretrain

    result = pretrain(args.data, args.out, model=args.model, train_config=_train_config(args), seq_len=args.seq_len)
    print(json.dumps({"step": result.step, "tokens": result.tokens, "train_loss": result.train_loss,
                      "val_loss": result.val_loss, "stopped_early": result.stopped_early}))
    return 0


def cmd_ship(args: argparse.Namespace) -> int:
    from kvgraft.train.ship import ship_reference

    command = args.command_line or "(not recorded)"
    out = ship_reference(args.run, args.data, args.out, command=command, overwrite=args.overwrite,
                         compare_with=args.compare_with)
    print(f"shipped {out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from kvgraft.eval import compare_table, evaluate, format_report
    from kvgraft.reference import resolve_model

    results = []
    models = args.model or [None]
    paths = [resolve_model(name) for name in models]
    tokens = None
    if args.text is None and len(paths) > 1:  # score every model on the same tokens
        tokens = next((p / "eval" / "heldout.npy" for p in paths if (p / "eval" / "heldout.npy").is_file()), None)
    for i, path in enumerate(paths):
        json_out = None
        if args.json:
            json_out = args.json if len(models) == 1 else Path(args.json).with_suffix(f".{i}.json")
        results.append(evaluate(
            model_path=path, text_file=args.text, tokens=tokens, seq_len=args.seq_len, contexts=tuple(args.contexts),
            batch_sizes=tuple(args.batch_sizes), new_tokens=args.new_tokens, json_out=json_out,
            max_tokens=args.max_tokens,
        ))
        print(format_report(results[-1]))
    if len(results) > 1:
        print(compare_table(results))
    if args.out:
        from kvgraft.eval.compare import write_compare_report

        print(f"report: {write_compare_report(results, args.out) / 'compare.md'}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kvgraft.serve.sampling import SamplingParams

    # every value is checked before the model loads
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed, stop=tuple(args.stop or ()))
    if sampling.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens ({args.max_new_tokens}) must be >= 1")

    from kvgraft.hf import load_pretrained, load_tokenizer_dir
    from kvgraft.reference import resolve_model
    from kvgraft.serve.engine import Engine

    path = resolve_model(args.model)
    tok = load_tokenizer_dir(path)
    if tok is None:
        raise FileNotFoundError(f"{path} has no tokenizer.json; generation needs one")
    ids = tok.encode(args.prompt)
    if not ids:
        raise ValueError("the prompt is empty after tokenization; give a non-empty --prompt")
    model = load_pretrained(path).eval()
    limit = model.config.max_position_embeddings
    if len(ids) + sampling.max_new_tokens > limit:
        raise ValueError(f"prompt ({len(ids)} tokens) + --max-new-tokens ({sampling.max_new_tokens}) exceeds the "
                         f"model's max_position_embeddings ({limit})")
    eos = model.config.eos_token_id
    if eos is not None:
        sampling = SamplingParams(**{**sampling.__dict__, "stop_token_ids": (eos,)})

    def detok(out: list[int]) -> str:
        return tok.decode(out, skip_special_tokens=True)

    engine = Engine(model, max_seqs=1, max_seq_len=len(ids) + sampling.max_new_tokens, detokenize=detok)
    rid = engine.add_request(ids, sampling)
    print(detok(ids), end="", flush=True)
    shown = ""
    while engine.has_unfinished():  # stream: print what each step adds to the decoded text
        engine.step()
        text = detok(engine.requests[rid].output)
        for stop in sampling.stop:
            if stop in text:
                text = text[: text.index(stop)]
        if text.startswith(shown):
            print(text[len(shown):], end="", flush=True)
            shown = text
    print()
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.after is not None:
        from kvgraft.graft.checklist import checklist, format_checklist

        if args.original is None:
            raise ValueError("--after needs --original (the model before conversion)")
        checks = checklist(args.after, args.original)
        print(format_checklist(checks))
        if args.json:
            from kvgraft.atomic import atomic_write_text

            atomic_write_text(args.json, json.dumps([c.to_dict() for c in checks], indent=2) + "\n")
        return 0
    from kvgraft.graft.doctor import doctor

    report = doctor(args.model, kv_lora_rank=args.kv_lora_rank, qk_rope_head_dim=args.rope_dim)
    print(report.format())
    if args.json:
        from kvgraft.atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from kvgraft.graft.convert import convert

    record = convert(
        args.model, args.out, kv_lora_rank=args.kv_lora_rank, qk_rope_head_dim=args.rope_dim,
        compression=args.compression, objective=args.objective, rope_selection=args.rope_selection,
        layerwise=args.layerwise, rope_expectation=args.rope_expectation,
        layers=tuple(args.layers) if args.layers else None,
        calibration=args.calibration, calibration_tokens=args.calibration_tokens, output_format=args.format,
        overwrite=args.overwrite, device=args.device, to=args.to,
        kv_source_layers=tuple(args.kv_source_layers) if args.kv_source_layers else None,
        sliding_window=args.sliding_window, compress_rate=args.compress_rate,
    )
    if args.to == "ced":
        share = record["share_graft"]
        fits = ", ".join(f"layer {layer} <- {r['source']}: {r['relative_residual']:.3f}"
                         for layer, r in share["readers"].items())
        print(f"share graft: kv_source layers {share['kv_source_layers']} (pivot {share['pivot']}), window "
              f"{share['sliding_window']}, m={share['compress_rate']}; least-squares residuals: {fits or 'none'}")
        for n, b in record["kv_cache_bytes_bf16"].items():
            print(f"KV bytes per sequence at {n} tokens (bf16): {b['original']:,} -> {b['converted']:,} "
                  f"({b['original'] / b['converted']:.2f}x smaller)")
    kv = record["kv_bytes_per_token_bf16"]
    print(f"converted {record['source']} -> {args.out}: KV bytes/token (bf16) {kv['original']:,} -> "
          f"{kv['converted']:,} ({record['compression']:.2f}x smaller) in {record['seconds']['convert']:.1f} s")
    return 0


def cmd_heal(args: argparse.Namespace) -> int:
    from kvgraft.train.heal import HealConfig, heal

    hc = HealConfig(loss=args.loss, kl_weight=args.kl_weight, temperature=args.temperature,
                    attention_only=args.attention_only, tokens=args.tokens,
                    fraction_of_pretraining=args.fraction)
    from kvgraft.train.config import TrainConfig

    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                 if getattr(args, f.name) is not None}
    result = heal(args.model, args.out, args.data, teacher=args.teacher, heal_config=hc,
                  train_overrides=overrides, original_lr=args.original_lr,
                  pretraining_tokens=args.pretraining_tokens, output_format=args.format)
    print(json.dumps({"step": result.step, "tokens": result.tokens, "train_loss": result.train_loss,
                      "val_loss": result.val_loss, "final": str(Path(args.out) / "final")}))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvgraft.demo import demo

    demo(args.model, out_dir=args.out, full=args.full)
    return 0


def _preset_name(name: str) -> str:
    """argparse type of ``pretrain --model``: checked when parsed, so that building the parser (and
    ``kvgraft --help``) does not import the model package, which imports torch."""
    from kvgraft.model.presets import PRESETS

    if name not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown model preset {name!r} (choose from {', '.join(sorted(PRESETS))})")
    return name


def build_parser() -> argparse.ArgumentParser:
    # Only light imports here (no torch, no transformers): `kvgraft --help` runs in a fraction of a second.
    from kvgraft.data.corpus import DEFAULT_SOURCES, SOURCES
    from kvgraft.train.config import TrainConfig

    parser = argparse.ArgumentParser(
        prog="kvgraft",
        description="kvgraft: graft MLA and shared KV caches onto pretrained transformer LMs, and measure them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("prepare-data", help="build the corpus, train the BPE tokenizer, tokenize the splits")
    p.add_argument("--out", required=True, help="output directory (corpus/, tokenizer/, tokens/)")
    p.add_argument("--sources", nargs="*", default=list(DEFAULT_SOURCES), choices=sorted(SOURCES),
                   help="corpus sources (Debian packages, installed with apt-get when missing)")
    p.add_argument("--files", nargs="*", default=[], help="extra text files, one document each")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_prepare_data)

    p = sub.add_parser("pretrain", help="pretrain a model from scratch on prepared data (resumable)")
    p.add_argument("--data", required=True, help="directory made by `kvgraft prepare-data`")
    p.add_argument("--out", required=True, help="run directory; rerun the same command to resume")
    p.add_argument("--model", default="llama-8m", type=_preset_name,
                   help="model preset, a name in kvgraft.model.presets.PRESETS (default: llama-8m)")
    p.add_argument("--seq-len", type=int, default=None, help="training sequence length (default: model context)")
    _add_train_args(p, TrainConfig(max_steps=1000))
    p.set_defaults(func=cmd_pretrain)

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
    p.add_argument("--compare", action="store_true",
                   help="side-by-side report of the models given (the first is the baseline); use with --out")
    p.add_argument("--out", default=None, help="directory for compare.md, compare.json and PNG plots")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="sample text from a model through the engine (greedy, temperature, "
                                        "top-p, stop strings), streamed")
    p.add_argument("model", nargs="?", default=None, help=model_help)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop when the output contains this text (repeatable)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("doctor", help="check-up before an MLA graft: architecture, KV bytes now and after, blockers")
    p.add_argument("model", nargs="?", default=None, help=model_help)
    p.add_argument("--kv-lora-rank", type=int, default=None, help="latent width d_c (default: KV width / 4)")
    p.add_argument("--rope-dim", type=int, default=None, help="shared RoPE key width d_rope (default: head_dim)")
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    p.add_argument("--after", default=None,
                   help="a converted or healed model: run the seed's troubleshooting checklist on it instead")
    p.add_argument("--original", default=None, help="with --after: the model before conversion")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("convert", help="graft multi-head latent attention (MLA) onto a Llama-family model, "
                                       "or make it a causal encoder-decoder (--to ced)")
    p.add_argument("model", nargs="?", default=None, help=model_help)
    p.add_argument("--out", required=True, help="output directory (refused if it exists, unless --overwrite)")
    p.add_argument("--to", choices=["mla", "ced"], default="mla",
                   help="mla: per-layer latent KV; ced: causal encoder-decoder with shared compressed KV written "
                        "by a few kv_source layers plus a sliding window per layer (the share graft)")
    p.add_argument("--kv-source-layers", type=int, nargs="+", default=None,
                   help="--to ced: layers that write the shared KV, the last is the pivot (default: pivot at "
                        "the middle layer, e.g. 1 3 4 for 8 layers)")
    p.add_argument("--sliding-window", type=int, default=64, help="--to ced: window of every layer (tokens)")
    p.add_argument("--compress-rate", type=int, default=1, help="--to ced: tokens pooled per shared entry (m)")
    p.add_argument("--compression", type=float, default=None,
                   help="per-layer latent KV reduction factor (default 4; 2 with --to ced); sets the latent "
                        "rank when --kv-lora-rank is not given")
    p.add_argument("--kv-lora-rank", type=int, default=None, help="latent width d_c cached per token per layer")
    p.add_argument("--rope-dim", type=int, default=None,
                   help="width of the shared RoPE key d_rope (default: the model's head_dim)")
    p.add_argument("--objective", choices=["weights", "activations", "attention"], default="attention",
                   help="latent initialisation: joint SVD of the weights, PCA of K/V outputs on calibration "
                        "text, or attention-aware (key error weighted by queries, value error by W_O)")
    p.add_argument("--rope-selection", choices=["auto", "stride", "norm", "shared"], default="auto",
                   help="which RoPE frequencies stay: every k-th (stock DeepSeek-V3 layout) or the largest "
                        "measured contributions per layer (kvgraft format only), or one layout for all layers "
                        "by measured contribution (shared); auto: norm, shared with --to ced, stride with --format "
                        "deepseek_v3/both")
    p.add_argument("--layerwise", action=argparse.BooleanOptionalAction, default=True,
                   help="calibrate each layer on the converted layers' activations")
    p.add_argument("--rope-expectation", action=argparse.BooleanOptionalAction, default=True,
                   help="pairs that lose RoPE keep their expected rotation under the layer's measured attention "
                        "distances (instead of none)")
    p.add_argument("--layers", type=int, nargs="+", default=None,
                   help="convert only these layers (progressive grafting); the rest stay as they are")
    p.add_argument("--calibration", default=None,
                   help="calibration text (.txt) or token ids (.npy); default: the model's eval/calibration.npy")
    p.add_argument("--calibration-tokens", type=int, default=32768)
    p.add_argument("--format", choices=["kvgraft", "deepseek_v3", "both"], default="kvgraft",
                   help="kvgraft's own format and/or a stock DeepSeek-V3 checkpoint (all layers converted)")
    p.add_argument("--device", default="cpu", help="where the model and calibration run, e.g. cuda")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_convert)

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
    p.add_argument("--original-lr", type=float, default=None,
                   help="the original's peak LR (default: from its card); healing uses 1/10 of it")
    p.add_argument("--pretraining-tokens", type=int, default=None, help="the original's pretraining tokens")
    p.add_argument("--format", choices=["kvgraft", "deepseek_v3", "both"], default="kvgraft",
                   help="output: kvgraft's own format and/or a stock DeepSeek-V3 checkpoint")
    heal_defaults = TrainConfig(max_steps=100, lr=1e-4, warmup_steps=10, precision="bf16")
    _add_train_args(p, heal_defaults)
    p.set_defaults(func=cmd_heal, lr=None)  # default LR: 1/10 of the original's

    p = sub.add_parser("demo", help="the `make demo` job: the reference model, its 4x MLA graft, and the two side by side")
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--out", default="runs/demo", help="where report.json goes")
    p.add_argument("--full", action="store_true",
                   help="the long version (minutes): perplexity on the whole held-out slice, the conversion's "
                        "default 32K calibration tokens, more decode steps; default: a quick setting (16K held-out "
                        "and 16K calibration tokens spread over the slices, fewer decode steps)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("ship", help="package a finished pretraining run as a reference model with its card")
    p.add_argument("run", help="pretraining run directory")
    p.add_argument("--data", required=True, help="the data directory the run trained on")
    p.add_argument("--out", required=True, help="output model directory, e.g. models/kvgraft-llama-8m")
    p.add_argument("--command-line", default=None, help="the exact pretrain command, recorded in the card")
    p.add_argument("--compare-with", default=None,
                   help="another shipped reference model to compare with in the card (e.g. models/kvgraft-llama-8m)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_ship)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (KvgraftError, ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"kvgraft: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
