"""``kvgraft fetch`` (a real model of the registry into the cache) and ``kvgraft import-gguf``."""

from __future__ import annotations

import argparse

from kvgraft.hf.fetch import fetch as fetch_model
from kvgraft.hf.gguf import import_gguf as run_import


def fetch(args: argparse.Namespace) -> int:
    print(fetch_model(args.name, overwrite=args.overwrite))
    return 0


def import_gguf(args: argparse.Namespace) -> int:
    report = run_import(args.file, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(report.format())
    return 0
