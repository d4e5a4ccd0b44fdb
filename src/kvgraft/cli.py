"""The ``kvgraft`` command: one subcommand per entry-point function, no logic of its own.

User errors (bad paths, bad values, corrupt checkpoints) print one line ``kvgraft: error: ...``
and exit with status 2. ``kvgraft doctor`` exits with status 3 (``EXIT_BLOCKED``) when its report has a
blocker (the report, and ``--json``, are written first), so a script can tell a blocked conversion.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvgraft.errors import KvgraftError

EXIT_ERROR = 2  # bad arguments, missing or corrupt files, out-of-range values: one line on stderr
EXIT_BLOCKED = 3  # kvgraft doctor: the report lists at least one blocker


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
                           files=args.files, tokenizer=args.tokenizer)
    for split, s in summary["splits"].items():
        print(f"{split:>10}: {s['documents']:>6} documents, {s['tokens']:>9,} tokens")
    return 0


def cmd_pretrain(args: argparse.Namespace) -> int:
    from kvgraft.train.pretrain import pretrain

    result = pretrain(args.data, args.out, model=args.model, train_config=_train_config(args), seq_len=args.seq_len)
    from accelerate import PartialState

    if PartialState().is_main_process:  # one summary line under torchrun / accelerate launch too
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
    from kvgraft.checks import check_writable
    from kvgraft.eval import compare_table, evaluate, format_report
    from kvgraft.eval.report import check_eval_args
    from kvgraft.reference import resolve_model

    # every value is checked before any model or token file is read
    check_eval_args(args.seq_len, args.max_tokens, args.contexts, args.batch_sizes, args.new_tokens)
    if args.json:
        check_writable(args.json, what="--json file")
    if args.out:
        check_writable(Path(args.out) / "compare.md", what="--out directory")
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
    from kvgraft.checks import check_text

    check_text("--prompt", args.prompt)  # argv bytes that are not UTF-8 arrive as lone surrogates
    for stop in args.stop or ():
        check_text("--stop", stop)
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
    from kvgraft.hf import load_config

    limit = load_config(path).max_position_embeddings  # checked on config.json, before the weights load
    if len(ids) + sampling.max_new_tokens > limit:
        raise ValueError(f"prompt ({len(ids)} tokens) + --max-new-tokens ({sampling.max_new_tokens}) exceeds the "
                         f"model's max_position_embeddings ({limit})")
    model = load_pretrained(path).eval()
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

    if args.json:
        from kvgraft.checks import check_writable

        check_writable(args.json, what="--json file")
    report = doctor(args.model, kv_lora_rank=args.kv_lora_rank, qk_rope_head_dim=args.rope_dim,
                    compression=args.compression, output_format=args.format)
    print(report.format())
    if args.json:
        from kvgraft.atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
    return EXIT_BLOCKED if report.blockers else 0


def cmd_convert(args: argparse.Namespace) -> int:
    from kvgraft.graft.convert import convert

    record = convert(
        args.model, args.out, kv_lora_rank=args.kv_lora_rank, qk_rope_head_dim=args.rope_dim,
        compression=args.compression, objective=args.objective, rope_selection=args.rope_selection,
        rope_rotation=args.rope_rotation,
        layerwise=args.layerwise, rope_expectation=args.rope_expectation,
        layers=tuple(args.layers) if args.layers else None,
        calibration=args.calibration, calibration_tokens=args.calibration_tokens, output_format=args.format,
        overwrite=args.overwrite, device=args.device, to=args.to,
        kv_source_layers=tuple(args.kv_source_layers) if args.kv_source_layers else None,
        sliding_window=args.sliding_window, compress_rate=args.compress_rate,
        calibration_shrinkage=args.calibration_shrinkage, target=args.target,
        stock_construction=args.stock_construction,
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


def cmd_tasks(args: argparse.Namespace) -> int:
    from kvgraft.data.tasks import SPLITS, TASK_SUMMARIES, TASKS, read_task_info, write_task

    if args.list:
        for name in TASKS:
            print(f"{name:>10}: {TASK_SUMMARIES[name]}")
        return 0
    if args.name is None or args.out is None:
        raise ValueError(f"give a task name ({', '.join(TASKS)}) and --out DIR, or --list")
    if args.name not in TASKS:
        raise ValueError(f"unknown task {args.name!r} (known: {', '.join(TASKS)})")
    from kvgraft.reference import resolve_model

    tokenizer, tokenizer_name = None, None
    try:  # token counts with the reference model's tokenizer, when there is one
        from kvgraft.data.tokenizer import load_tokenizer

        path = resolve_model(args.tokenizer)
        tokenizer, tokenizer_name = load_tokenizer(path), path.name
    except (KvgraftError, FileNotFoundError) as exc:
        if args.tokenizer is not None:
            raise
        print(f"kvgraft: note: no token counts ({exc})", file=sys.stderr)
    out = write_task(args.name, args.out, seed=args.seed, tokenizer=tokenizer, tokenizer_name=tokenizer_name,
                     overwrite=args.overwrite)
    info = read_task_info(out)
    tokens = info.get("tokens", {}).get("splits", {})
    print(f"{args.name} (seed {args.seed}, generator v{info['generator_version']}) -> {out}")
    for split in SPLITS:
        line = f"{split:>10}: {info['sizes'][split]:>5} examples"
        if split in tokens:
            t = tokens[split]
            line += f", {t['mean']:.1f} tokens per example (min {t['min']}, max {t['max']})"
        print(line)
    if tokens:
        print(f"{'all':>10}: {info['tokens']['all']['mean']:.1f} tokens per example (prompt + answer, "
              f"{tokenizer_name} tokenizer)")
    return 0


def _preset_name(name: str) -> str:
    """argparse type of ``pretrain --model``: checked when parsed, so that building the parser (and
    ``kvgraft --help``) does not import the model package, which imports torch."""
    from kvgraft.model.presets import PRESETS

    if name not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown model preset {name!r} (choose from {', '.join(sorted(PRESETS))})")
    return name


def _adapt_config(args: argparse.Namespace):
    from kvgraft.adapters.placement import Placement
    from kvgraft.train.adapt import DEFAULT_PRESET, AdaptConfig

    mults = []
    for item in args.lr_mult or ():
        glob, sep, factor = item.rpartition("=")
        if not sep or not glob:
            raise ValueError(f"--lr-mult {item!r} must look like GLOB=FACTOR, e.g. '*.compressor.*=0.1'")
        try:
            mults.append((glob, float(factor)))
        except ValueError:
            raise ValueError(f"--lr-mult {item!r}: {factor!r} is not a number") from None
    placement = None
    if args.layers is not None or args.modules is not None or args.include or args.exclude:
        layers = args.layers or "all"
        if layers not in ("all", "encoder-half", "decoder-half") and not layers.startswith("from:"):
            try:
                layers = tuple(int(x) for x in layers.split(","))
            except ValueError:
                raise ValueError(f"--layers {args.layers!r}: all, encoder-half, decoder-half, from:K or a list "
                                 "like 4,5,6") from None
        placement = Placement(layers, tuple(args.modules or ("all-linear",)), tuple(args.include or ()),
                              tuple(args.exclude or ()))
    preset = args.preset
    if placement is not None:  # the placement given; the rank from --rank, else from --preset or the default
        preset = None if args.rank is not None else (preset or DEFAULT_PRESET)
    return AdaptConfig(preset=preset, placement=placement, rank=args.rank, alpha=args.alpha, dropout=args.dropout,
                       freeze_kv_writers=args.freeze_kv_writers, freeze=tuple(args.freeze or ()),
                       lr_multipliers=tuple(mults), loraplus_ratio=args.loraplus_ratio, steps=args.steps, lr=args.lr,
                       micro_batch_size=args.micro_batch_size, seed=args.seed,
                       gradient_checkpointing=args.gradient_checkpointing, accuracy_examples=args.accuracy_examples,
                       val_examples=args.val_examples, test_examples=args.test_examples,
                       require_sharing=args.share_cache)


def cmd_adapt(args: argparse.Namespace) -> int:
    from kvgraft.train.adapt import adapt

    cfg = _adapt_config(args)
    result = adapt(args.base, args.task, args.out, cfg, dry_run=args.dry_run,
                   log=lambda line: print(line, flush=True))  # the note before training, when it will not share
    share = result.get("sharing")  # absent when the run stopped early (no adapter yet)
    if args.dry_run:
        for row in result["modules"]:
            print(f"{row['module']:<48} {row['in']:>6} -> {row['out']:<6} {row['lora_params']:>10,}")
        cert = result["certificate"]
        print(f"{len(result['modules'])} modules, {result['trainable_parameters']:,} trainable parameters "
              f"({100 * result['trainable_parameters'] / result['base_parameters']:.2f}% of the base's "
              f"{result['base_parameters']:,})")
        print(f"sharing certificate: {share['verdict']}")
        print(f"  untouched cache groups: {', '.join(cert['untouched']) or '-'}")
        print(f"  touched cache groups:   {', '.join(cert['touched']) or '-'}")
        return 0
    keys = ("task", "steps", "val_loss_protocol", "test_loss", "test_accuracy", "step_time_s", "trainable_parameters")
    print(json.dumps({k: result.get(k) for k in keys} | {"adapter": str(Path(args.out) / "adapter")}))
    if share is not None:
        print(f"sharing certificate: {share['verdict']}")  # the run's last line
    return 0


def cmd_experiment(args: argparse.Namespace) -> int:
    from kvgraft.train.experiment import DEFAULT_CONFIGS, placement_curve, placement_study

    if args.sweep_first_layer:
        curve = placement_curve(args.base, args.task, args.out, seeds=args.seeds, steps=args.steps, rank=args.rank,
                                lr=args.lr, micro_batch_size=args.micro_batch_size)
        print((Path(args.out) / "curve.md").read_text())
        print(f"plot: {Path(args.out) / 'curve.png'}; pivot layer {curve['pivot']}")
        return 0
    placement_study(args.base, args.task, args.out, seeds=args.seeds, steps=args.steps,
                    configs=tuple(args.configs or DEFAULT_CONFIGS), lr=args.lr,
                    micro_batch_size=args.micro_batch_size, accuracy_examples=args.accuracy_examples)
    print((Path(args.out) / "study.md").read_text())
    print(f"curves: {Path(args.out) / 'curves.png'}")
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from kvgraft.adapters.probe import probe, probe_markdown

    result = probe(args.adapter, args.task, base=args.base, steps=args.steps, micro_batch_size=args.micro_batch_size,
                   val_examples=args.val_examples)
    text = probe_markdown(result)
    print(text)
    if args.out:
        from kvgraft.atomic import atomic_write_text

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "probe.md", text)
        atomic_write_text(out / "probe.json", json.dumps(result, indent=2) + "\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    adapters = {}
    for spec in args.adapter or ():
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--adapter {spec!r} must be NAME=PATH")
        if name in adapters:
            raise ValueError(f"--adapter names {name!r} twice")
        adapters[name] = path
    if not 0 < args.port < 65536:
        raise ValueError(f"--port ({args.port}) must be in 1..65535")
    from kvgraft.serve.server import build_server, serve

    server = build_server(args.model, adapters, model_name=args.model_name, max_seqs=args.max_seqs,
                          max_batch_tokens=args.max_batch_tokens, max_queue=args.max_queue,
                          max_tokens_limit=args.max_tokens_limit, max_request_bytes=args.max_request_bytes,
                          adapter_dir=args.adapter_dir, prefix_cache=not args.no_prefix_cache,
                          with_shipped_adapters=not args.no_shipped_adapters)
    served = sorted(server.engine.adapters.adapters)
    print(f"serving {server.config.model_name} with adapters {', '.join(served) or 'none'} on "
          f"http://{args.host}:{args.port}/v1", flush=True)
    serve(server, args.host, args.port, log_level=args.log_level)
    return 0


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
    p.add_argument("--tokenizer", default=None,
                   help="reuse this directory's tokenizer.json (e.g. a shipped model's) instead of training one: "
                        "rebuilds that model's data with exactly its token ids")
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

    p = sub.add_parser("doctor", help="check-up before an MLA graft: architecture, KV bytes now and after, blockers",
                       epilog=f"exit status: 0 when nothing blocks the conversion, {EXIT_BLOCKED} when the report "
                              f"lists a blocker (the report and --json are written either way), {EXIT_ERROR} for "
                              "bad arguments or an unreadable model")
    p.add_argument("model", nargs="?", default=None, help=model_help)
    p.add_argument("--compression", type=float, default=None,
                   help="per-layer KV reduction factor that sets the budget d_c + d_rope (default 4), as in convert")
    p.add_argument("--kv-lora-rank", type=int, default=None,
                   help="latent width d_c (default: convert's rule, docs/ranks.md)")
    p.add_argument("--rope-dim", type=int, default=None,
                   help="shared RoPE key width d_rope (default: convert's rule, docs/ranks.md)")
    p.add_argument("--format", choices=["kvgraft", "deepseek_v3", "both"], default="kvgraft",
                   help="the format convert would write (deepseek_v3/both: stock-exportable default ranks)")
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
                   help="per-layer KV reduction factor (default 4; 2 with --to ced): the budget d_c + d_rope = "
                        "KV width / compression, split by the default rank rule (docs/ranks.md)")
    p.add_argument("--kv-lora-rank", type=int, default=None,
                   help="latent width d_c cached per token per layer (instead of --compression)")
    p.add_argument("--rope-dim", type=int, default=None,
                   help="width of the shared RoPE key d_rope (default: the largest even width <= min(64, "
                        "head_dim, budget / 2); a divisor of head_dim with --format deepseek_v3/both)")
    p.add_argument("--objective", choices=["weights", "activations", "attention"], default="attention",
                   help="latent initialisation: joint SVD of the weights, PCA of K/V outputs on calibration "
                        "text, or attention-aware (key error weighted by queries, value error by W_O)")
    p.add_argument("--rope-selection", choices=["auto", "stride", "prefix", "norm", "shared"], default="auto",
                   help="which RoPE frequencies stay: the fastest d_rope/2 (prefix) or every k-th (stride), "
                        "both stock DeepSeek-V3 layouts, or the largest measured contributions per layer (norm, "
                        "kvgraft format only), or one layout for all layers by measured contribution (shared); "
                        "auto: norm, shared with --to ced, prefix with --format deepseek_v3/both")
    p.add_argument("--rope-rotation", choices=["real", "complex"], default=None,
                   help="how the KV heads' RoPE pairs are mixed per frequency before the kept ones are chosen: "
                        "orthogonal (real) or unitary (complex: each kept pair the best rank-1 complex fit of the "
                        "heads' pairs, a per-head phase folded into the queries); default complex (--to mla), "
                        "real (--to ced)")
    p.add_argument("--layerwise", action=argparse.BooleanOptionalAction, default=True,
                   help="calibrate each layer on the converted layers' activations")
    p.add_argument("--calibration-shrinkage", type=float, default=0.5,
                   help="shrink each layer's calibration second moment toward the weights-only fit's, in [0, 1] "
                        "(0: the calibrated fit as measured; default 0.5, measured to generalise better out of "
                        "domain: bench/RESULTS.md)")
    p.add_argument("--rope-expectation", action=argparse.BooleanOptionalAction, default=True,
                   help="pairs that lose RoPE keep their expected rotation under the layer's measured attention "
                        "distances (instead of none)")
    p.add_argument("--layers", type=int, nargs="+", default=None,
                   help="convert only these layers (progressive grafting); the rest stay as they are")
    p.add_argument("--calibration", default=None,
                   help="calibration text (.txt) or token ids (.npy); default: the model's eval/calibration.npy")
    p.add_argument("--calibration-tokens", type=int, default=32768)
    p.add_argument("--format", choices=["kvgraft", "deepseek_v3", "both"], default=None,
                   help="kvgraft's own format and/or a stock DeepSeek-V3 checkpoint (all layers converted); "
                        "default kvgraft, or deepseek_v3 with --target")
    p.add_argument("--target", choices=["vllm"], default=None,
                   help="shape the stock DeepSeek-V3 export for an engine: vllm = d_c 512 + d_rope 64, the only "
                        "shape vLLM's CPU backends and FlashMLA-class kernels take (refused, saying why, when the "
                        "model's KV width or head_dim cannot); `kvgraft doctor` lists what each backend accepts")
    p.add_argument("--stock-construction", choices=["engines", "transformers"], default="engines",
                   help="engines (default): no attention bias tensors and fp16-safe weights, so vLLM and SGLang "
                        "compute what transformers does (latent norm fitted, biases folded: approximate, error "
                        "printed); transformers: the exact constructions held in attention biases, which vLLM and "
                        "SGLang drop (transformers only; docs/export.md)")
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

    p = sub.add_parser("tasks", help="write a synthetic fine-tuning task (geometry, ui-reply, recall) as JSONL splits")
    p.add_argument("name", nargs="?", default=None, help="task name (see --list)")
    p.add_argument("--out", default=None, help="output directory (refused if not empty, unless --overwrite)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list the tasks and exit")
    p.add_argument("--tokenizer", default=None,
                   help="model directory or reference model name whose tokenizer counts tokens per example "
                        "(default: the default reference model's, when available)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_tasks)

    p = sub.add_parser("ship", help="package a finished pretraining run as a reference model with its card")
    p.add_argument("run", help="pretraining run directory")
    p.add_argument("--data", required=True, help="the data directory the run trained on")
    p.add_argument("--out", required=True, help="output model directory, e.g. models/kvgraft-llama-8m")
    p.add_argument("--command-line", default=None, help="the exact pretrain command, recorded in the card")
    p.add_argument("--compare-with", default=None,
                   help="another shipped reference model to compare with in the card (e.g. models/kvgraft-llama-8m)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_ship)

    p = sub.add_parser("adapt", help="train a placement-aware LoRA adapter (PEFT format, sharing certificate)")
    p.add_argument("base", nargs="?", default=None, help="base model directory or shipped name (default: "
                   "kvgraft-llama-8m; kvgraft-ced-8m is the causal encoder-decoder the placements are made for)")
    p.add_argument("--task", required=True, help="task directory (kvgraft tasks NAME --out DIR) or name: geometry, ui-reply, recall")
    p.add_argument("--out", required=True, help="run directory (adapter in OUT/adapter, result in OUT/result.json)")
    p.add_argument("--preset", default=None,
                   help="all-linear-r16, encoder-half-r16, decoder-half-r16, all-linear-r8, slim-attention-r16, "
                        "no-mlp-down-r16 (default: decoder-half-r16, with the pivot's KV writers frozen on a causal "
                        "encoder-decoder: the placement whose adapter shares the base's cache)")
    p.add_argument("--layers", default=None, help="all, encoder-half, decoder-half, from:K or a list like 4,5,6")
    p.add_argument("--modules", nargs="+", default=None,
                   help="module groups: all-linear attention attention-out query kv-writers mlp mlp-gate-up mlp-down")
    p.add_argument("--include", nargs="+", default=None, help="module globs to add, e.g. 'layers.2.mlp.*'")
    p.add_argument("--exclude", nargs="+", default=None, help="module globs to remove, e.g. '*.q_proj'")
    p.add_argument("--freeze-kv-writers", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the pivot's KV-writing projections frozen (default: frozen in the default placement "
                        "on a causal encoder-decoder, not otherwise; --no-freeze-kv-writers adapts them)")
    p.add_argument("--share-cache", action="store_true",
                   help="require an adapter that shares the base's cache: refuse before training (exit 2) a "
                        "placement that cannot, or a base without a shared cache. Without it, such a placement is "
                        "trained, with a note saying why it will not share")
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
    p.add_argument("--test-examples", type=int, default=None,
                   help="test problems scored for the test loss (default: all)")
    p.add_argument("--dry-run", action="store_true", help="list every matched module and the trainable count, then stop")
    p.set_defaults(func=cmd_adapt)

    p = sub.add_parser("experiment", help="placement studies over seeds (the seed's protocol) and the placement curve")
    p.add_argument("kind", choices=["placement"])
    p.add_argument("--base", default="kvgraft-ced-8m")
    p.add_argument("--task", required=True, help="task directory or name (geometry, ui-reply, recall)")
    p.add_argument("--out", required=True, help="study directory (rerun the same command to continue)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--configs", nargs="+", default=None,
                   help="presets, optionally with '+frozen-kv-writers' (default: the seed's set)")
    p.add_argument("--lr", type=float, default=None, help="skip the LR sweep and use this LR")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--accuracy-examples", type=int, default=100, help="test problems answered greedily per run")
    p.add_argument("--sweep-first-layer", action="store_true",
                   help="the placement curve: adapters on layers k..L-1 for every k (needs --lr)")
    p.add_argument("--rank", type=int, default=16, help="rank for --sweep-first-layer")
    p.set_defaults(func=cmd_experiment)

    p = sub.add_parser("probe", help="which adapter modules matter: gradient energy (rho_c) and zeroing ablation")
    p.add_argument("adapter", help="an adapter directory written by kvgraft adapt (OUT/adapter)")
    p.add_argument("--task", required=True, help="task directory or name (geometry, ui-reply, recall)")
    p.add_argument("--base", default=None, help="base model (default: the one the adapter was trained on)")
    p.add_argument("--steps", type=int, default=8, help="micro-batches of gradient energy")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--val-examples", type=int, default=224)
    p.add_argument("--out", default=None, help="directory for probe.md and probe.json")
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server over the engine, many adapters on one base "
                                     "(/v1/completions, /v1/chat/completions, /v1/models, /metrics)")
    p.add_argument("model", nargs="?", default=None, help=model_help)
    p.add_argument("--adapter", action="append", metavar="NAME=PATH",
                   help="load an adapter directory (kvgraft adapt's OUT/adapter) under NAME (repeatable)")
    p.add_argument("--adapter-dir", default=None,
                   help="directory that /v1/load_lora_adapter may load from (default: loading over HTTP is off)")
    p.add_argument("--model-name", default=None, help="the base's name in requests (default: its directory name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-seqs", type=int, default=16, help="requests running at once")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per engine step")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond --max-seqs; more get 429")
    p.add_argument("--max-tokens-limit", type=int, default=1024, help="the most max_tokens a request may ask")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="turn the engine's prefix cache off (every prompt is prefilled in full)")
    p.add_argument("--no-shipped-adapters", action="store_true",
                   help="do not load the example adapters shipped for this base (models/adapters/, e.g. "
                        "kvgraft-ced-8m-geometry for kvgraft-ced-8m), only the --adapter ones")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (KvgraftError, ValueError, OSError) as exc:  # OSError: unwritable outputs, full disks, ...
        print(f"kvgraft: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
