"""``kvgraft demo``: the main job on the shipped reference model."""

from __future__ import annotations

import argparse

from kvgraft.demo import demo as run_demo


def demo(args: argparse.Namespace) -> int:
    run_demo(args.model, out_dir=args.out, full=args.full)
    return 0
