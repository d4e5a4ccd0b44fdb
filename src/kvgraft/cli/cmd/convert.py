"""``kvgraft convert``: its options are ``kvgraft.graft.options.ConvertOptions``' fields."""

from __future__ import annotations

import argparse

from kvgraft.graft.convert import convert as run_convert
from kvgraft.graft.options import ConvertOptions, options_from_cli


def convert(args: argparse.Namespace) -> int:
    record = run_convert(args.model, args.out, ConvertOptions(**options_from_cli(args)))
    if record.to == "ced":
        share = record.share_graft
        if share is None:  # the share graft always reports for --to ced: a bug
            raise RuntimeError("the --to ced conversion returned no share-graft report")
        fits = ", ".join(f"layer {layer} <- {r['source']}: {r['relative_residual']:.3f}" for layer, r in share["readers"].items())
        print(
            f"share graft: kv_source layers {share['kv_source_layers']} (pivot {share['pivot']}), window "
            f"{share['sliding_window']}, m={share['compress_rate']}; least-squares residuals: {fits or 'none'}"
        )
        for n, b in record.kv_cache_bytes_bf16.items():
            print(
                f"KV bytes per sequence at {n} tokens (bf16): {b['original']:,} -> {b['converted']:,} "
                f"({b['original'] / b['converted']:.2f}x smaller)"
            )
    kv = record.kv_bytes_per_token_bf16
    print(
        f"converted {record.source} -> {args.out}: KV bytes/token (bf16) {kv['original']:,} -> "
        f"{kv['converted']:,} ({record.compression:.2f}x smaller) in {record.seconds['convert']:.1f} s"
    )
    return 0
