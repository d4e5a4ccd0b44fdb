"""``kvgraft doctor``: can a model take MLA, and (``--after``) the TransMLA article's checklist on a result."""

from __future__ import annotations

import argparse
import json

from kvgraft.atomic import atomic_write_text
from kvgraft.checks import check_writable
from kvgraft.cli.exit_codes import EXIT_BLOCKED
from kvgraft.errors import ConfigError
from kvgraft.graft.checklist import checklist, format_checklist
from kvgraft.graft.doctor import doctor as run_doctor


def doctor(args: argparse.Namespace) -> int:
    if args.after is not None:
        if args.original is None:
            raise ConfigError("--after needs --original (the model before conversion)")
        checks = checklist(args.after, args.original)
        print(format_checklist(checks))
        if args.json:
            atomic_write_text(args.json, json.dumps([c.to_dict() for c in checks], indent=2) + "\n")
        return 0
    if args.json:
        check_writable(args.json, what="--json file")
    report = run_doctor(
        args.model,
        kv_lora_rank=args.kv_lora_rank,
        qk_rope_head_dim=args.rope_dim,
        compression=args.compression,
        output_format=args.format,
    )
    print(report.format())
    if args.json:
        atomic_write_text(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
    return EXIT_BLOCKED if report.blockers else 0
