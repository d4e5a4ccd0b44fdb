"""The ``kvgraft`` subcommands for data, training, evaluation, generation and conversion: each calls one
entry-point function and prints its result; no logic of its own."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kvgraft.cli.exit_codes import EXIT_BLOCKED
from kvgraft.errors import KvgraftError


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
    # every value is checked before the model loads
    from kvgraft.checks import check_text
    from kvgraft.runtime.sampling import SamplingParams
    from kvgraft.runtime.stops import StopStrings

    check_text("--prompt", args.prompt)  # argv bytes that are not UTF-8 arrive as lone surrogates
    for stop in args.stop or ():
        check_text("--stop", stop)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed, stop=tuple(args.stop or ()))
    if sampling.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens ({args.max_new_tokens}) must be >= 1")

    from kvgraft.hf import load_pretrained, load_tokenizer_dir
    from kvgraft.reference import resolve_model
    from kvgraft.runtime.engine import Engine

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
    stops = StopStrings(sampling.stop)
    shown = ""
    while engine.has_unfinished():  # stream: print what each step adds to the decoded text
        engine.step()
        req = engine.requests[rid]
        # cut before a stop string; until the end, hold back a tail that could begin one
        text = stops.visible(detok(req.output), finished=req.status == "finished")
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
