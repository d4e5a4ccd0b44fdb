"""transformers' own CLI with kvgraft's format registered, so ``transformers serve`` can load kvgraft models.

``transformers serve`` is a separate program that never imports kvgraft, and it resolves a checkpoint's
class as ``getattr(transformers, config.architectures[0])``. This entry point imports :mod:`kvgraft.hf`
first (Auto classes, and ``transformers.KvgraftForCausalLM``), then runs transformers' CLI unchanged::

    python -m kvgraft.hf.transformers_cli serve models/kvgraft-ced-8m --continuous-batching --device cpu

(continuous batching on kvgraft's models: :mod:`kvgraft.hf.continuous`; docs/transformers.md).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from transformers.cli.transformers import app  # lazy: transformers' CLI, imported only when this wrapper runs

    import kvgraft.hf  # noqa: F401  (registers kvgraft's format with transformers)

    app(args=sys.argv[1:] if argv is None else argv, prog_name="transformers")


if __name__ == "__main__":
    main()
