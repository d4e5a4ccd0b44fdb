"""``build_parser()``: the ``kvgraft`` parser, every subcommand in the order ``kvgraft --help`` lists them
(each declared in :mod:`kvgraft.cli.args`).

Only light imports here (no torch, no transformers): `kvgraft --help` runs in a fraction of a second.
"""

from __future__ import annotations

import argparse

from kvgraft.cli.args import adapters, convert, data, demo, doctor, evaluate, generate, models, serve, train

SUBCOMMANDS = (
    data.add_prepare_data,
    train.add_pretrain,
    evaluate.add_eval,
    generate.add_generate,
    doctor.add_doctor,
    convert.add_convert,
    train.add_heal,
    demo.add_demo,
    data.add_tasks,
    train.add_ship,
    adapters.add_adapt,
    adapters.add_experiment,
    adapters.add_probe,
    serve.add_serve,
    models.add_fetch,
    models.add_import_gguf,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgraft",
        description="kvgraft: graft MLA and shared KV caches onto pretrained transformer LMs, and measure them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser
