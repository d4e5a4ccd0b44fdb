"""``kvgraft generate``: stream one completion from a model, through the engine."""

from __future__ import annotations

import argparse

from kvgraft.checks import check_text
from kvgraft.errors import ConfigError, refusals_as_config_errors
from kvgraft.hf import load_config, load_pretrained, load_tokenizer_dir
from kvgraft.reference import resolve_model
from kvgraft.runtime.detok import IncrementalText
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams
from kvgraft.runtime.stops import StopStrings


def generate(args: argparse.Namespace) -> int:
    # every value is checked before the model loads
    check_text("--prompt", args.prompt)  # argv bytes that are not UTF-8 arrive as lone surrogates
    for stop in args.stop or ():
        check_text("--stop", stop)
    with refusals_as_config_errors():  # the runtime refuses bad values with a plain ValueError
        sampling = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop or ()),
        )
    if sampling.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens ({args.max_new_tokens}) must be >= 1")
    path = resolve_model(args.model)
    tok = load_tokenizer_dir(path)
    if tok is None:
        raise FileNotFoundError(f"{path} has no tokenizer.json; generation needs one")
    ids = tok.encode(args.prompt)
    if not ids:
        raise ConfigError("the prompt is empty after tokenization; give a non-empty --prompt")
    limit = load_config(path).max_position_embeddings  # checked on config.json, before the weights load
    if len(ids) + sampling.max_new_tokens > limit:
        raise ConfigError(
            f"prompt ({len(ids)} tokens) + --max-new-tokens ({sampling.max_new_tokens}) exceeds the "
            f"model's max_position_embeddings ({limit})"
        )
    model = load_pretrained(path).eval()
    eos = model.config.eos_token_id
    if eos is not None:
        sampling = SamplingParams(**{**sampling.__dict__, "stop_token_ids": (eos,)})

    def detok(out: list[int]) -> str:
        return str(tok.decode(out, skip_special_tokens=True))

    engine = Engine(model, EngineOptions(max_seqs=1, max_seq_len=len(ids) + sampling.max_new_tokens), detokenize=detok)
    rid = engine.add_request(ids, sampling)
    print(detok(ids), end="", flush=True)
    stops, decoded = StopStrings(sampling.stop), IncrementalText(detok)
    shown = ""
    while engine.has_unfinished():  # stream: print what each step adds to the decoded text
        engine.step()
        req = engine.requests[rid]
        # cut before a stop string; until the end, hold back a tail that could begin one
        text = stops.visible(decoded.text(req.output), finished=req.status == "finished")
        if text.startswith(shown):
            print(text[len(shown) :], end="", flush=True)
            shown = text
    print()
    return 0
