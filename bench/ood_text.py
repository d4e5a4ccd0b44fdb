"""Build the out-of-domain evaluation text (Debian Reference manual) for a model: see kvgraft.data.ood.

.venv/bin/python bench/ood_text.py [--model models/kvgraft-llama-8m] [--out runs/ood/debian-reference.npy]
"""

from __future__ import annotations

import argparse
import json

from kvgraft.data.ood import build_ood_eval
from kvgraft.reference import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="runs/ood/debian-reference.npy")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    record = build_ood_eval(resolve_model(args.model), args.out, tokens=args.tokens, chunk=args.chunk)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
