"""``kvgraft convert``: a checkpoint directory in, an MLA-grafted (``--to mla``) or causal encoder-decoder
(``--to ced``: MLA graft with one RoPE layout, then the share graft of ``kvgraft.graft.ced``) directory out.

The output directory is written atomically (an interrupted conversion leaves nothing). It is itself the
converted model in kvgraft's own format (``model_type: kvgraft``; ``kvgraft eval OUT`` works), plus
``conversion.json`` (what was done, with timings), the tokenizer and the eval slices of the input when it
has them, and, with ``--format deepseek_v3`` or ``both``, a stock DeepSeek-V3 export in ``deepseek_v3/``
(``kvgraft.hf.deepseek``; what is exact for each family: ``docs/export.md``). For that format the graft keeps
one latent value for the export's constant coordinate (its exact latent norm), linearises Qwen3's q/k norms,
and the export's report (exactness, measured error and calibration-tail perplexities) is printed and
recorded in ``conversion.json``.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from kvgraft.atomic import atomic_dir
from kvgraft.graft.mla import GraftConfig, graft_mla, mla_model_config
from kvgraft.graft.ranks import DEFAULT_CED_COMPRESSION, DEFAULT_COMPRESSION, STOCK_ROPE_SELECTION, default_ranks
from kvgraft.model import ModelConfig

FORMATS = ("kvgraft", "deepseek_v3", "both")
TARGETS = ("mla", "ced")
SERVE_TARGETS = ("vllm",)  # engines convert can shape the stock export for (kvgraft.hf.engines)
STOCK_CONSTRUCTIONS = ("engines", "transformers")  # kvgraft.hf.deepseek.STOCK_TARGETS
CALIBRATION = Path("eval") / "calibration.npy"


def ranks_for_compression(config: ModelConfig, compression: float, qk_rope_head_dim: int) -> int:
    """d_c such that each layer caches KV width / compression values (d_c + d_rope), rounded down
    (``kvgraft.graft.ranks.default_ranks`` with d_rope given)."""
    return default_ranks(config, compression=compression, qk_rope_head_dim=qk_rope_head_dim).kv_lora_rank


def load_calibration(
    model_dir: Path, calibration: str | Path | None, tokens: int, seq_len: int, tokenizer=None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """(N, seq_len) calibration ids: from a .npy token file, a text file, or the model's shipped slice."""
    if calibration is None:
        if not (model_dir / CALIBRATION).is_file():
            raise ValueError(
                f"{model_dir} has no {CALIBRATION}; pass calibration text (a .txt or a .npy of token ids) "
                "or use objective 'weights'"
            )
        calibration = model_dir / CALIBRATION
    path = Path(calibration)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {path} does not exist")
    if path.suffix == ".npy":
        stream = np.load(path, mmap_mode="r")
    else:
        if tokenizer is None:
            raise ValueError(f"{model_dir} has no tokenizer to tokenize {path}; pass a .npy of token ids")
        stream = np.asarray(tokenizer.encode(path.read_text(encoding="utf-8")), dtype=np.int64)
    n = min(tokens, len(stream)) // seq_len
    if n == 0:
        raise ValueError(f"calibration {path} has {len(stream)} tokens, fewer than one window of {seq_len}")
    ids = torch.from_numpy(np.asarray(stream[: n * seq_len], dtype=np.int64)).view(n, seq_len)
    if vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"calibration {path} holds token ids in [{int(ids.min())}, {int(ids.max())}], outside the "
                         f"model's vocabulary [0, {vocab_size}); was it tokenized for another model?")
    return ids


TAIL_SEQUENCES = 8  # calibration sequences (the last ones) that the reported errors are measured on


@torch.no_grad()
def _tail_figures(original, converted, ids: torch.Tensor) -> dict:
    """Perplexity of the original and the converted model, and their max |logit diff|, on ``ids``."""
    from kvgraft.hf.deepseek import perplexity

    device = original.embed_tokens.weight.device
    was = original.training, converted.training
    original.eval()
    converted.eval()
    try:
        a = original(ids.to(device)).double().cpu()
        b = converted(ids.to(device)).double().cpu()
    finally:
        original.train(was[0])
        converted.train(was[1])
    return {"sequences": ids.shape[0], "seq_len": ids.shape[1], "original_perplexity": perplexity(a, ids),
            "converted_perplexity": perplexity(b, ids),
            "converted_max_abs_logit_diff_vs_original": float((a - b).abs().max())}


def convert(
    model: str | Path,
    out: str | Path,
    *,
    kv_lora_rank: int | None = None,
    qk_rope_head_dim: int | None = None,
    compression: float | None = None,
    objective: str = "attention",
    rope_selection: str = "auto",
    layerwise: bool = True,
    rope_expectation: bool = True,
    layers: tuple[int, ...] | None = None,
    calibration: str | Path | None = None,
    calibration_tokens: int = 32768,
    calibration_seq_len: int = 512,
    output_format: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    device: str = "cpu",
    to: str = "mla",
    kv_source_layers: tuple[int, ...] | None = None,
    sliding_window: int = 64,
    compress_rate: int = 1,
    calibration_shrinkage: float = 0.5,
    rope_rotation: str | None = None,
    target: str | None = None,
    stock_construction: str = "engines",
) -> dict:
    """Convert ``model`` (a local checkpoint directory) to MLA and write it to ``out``.

    Ranks not given come from the one rule of ``kvgraft.graft.ranks.default_ranks`` (shared with ``doctor``):
    the budget is KV width / ``compression`` values per layer (default 4x; or an explicit ``kv_lora_rank``),
    d_rope the largest even width <= min(64, head_dim, budget/2) (for the stock format's default prefix
    layout also <= 3/4 head_dim; a divisor of head_dim with --rope-selection stride), d_c the rest. Every
    argument (and the output path, device and calibration file) is checked before the weights are loaded;
    weights with NaN/Inf are refused, naming the tensor.
    Defaults (objective "attention", layer-wise, RoPE expectation, rope_selection "auto" = "norm", or
    "prefix" when a stock DeepSeek-V3 export is asked for) are the best of ``bench/mla_oneshot.py`` and
    ``bench/mla_ood.py``. ``rope_rotation`` (None: "complex" for ``to="mla"``, "real" for ``to="ced"``): how the
    KV heads' RoPE pairs are mixed per frequency before the kept ones are chosen (``GraftConfig``); the complex
    mix (each kept pair the best rank-1 complex fit of the heads' pairs) measured far better in both formats.
    ``device`` holds the model and the calibration activations (e.g. "cuda" for a 7B model); the
    per-layer factorisations run on the CPU in fp64. Returns the record written to ``conversion.json``.

    ``output_format`` (None: "deepseek_v3" with ``target``, else "kvgraft"). ``stock_construction``: how the
    stock DeepSeek-V3 export is written (``export_deepseek_v3``'s ``target``): "engines" (default: no attention
    bias tensors, fp16-safe weights, the latent norm fitted; what vLLM and SGLang compute as transformers
    does) or "transformers" (the exact bias constructions, which only transformers computes; the graft then
    keeps d_c - 1 so the constant latent coordinate stays within the budget). ``target="vllm"``: the stock
    export shaped for vLLM's CPU backends and FlashMLA-class kernels, d_c = 512 and d_rope = 64; refused,
    saying why, when the model's KV width or head_dim cannot take it (``kvgraft.hf.engines.vllm_shape_problem``).

    ``to="ced"`` makes a causal encoder-decoder: ``kv_source_layers`` (default: pivot at the middle layer,
    see ``default_kv_sources``), ``sliding_window`` and ``compress_rate`` as in ModelConfig. A Llama-family
    input is first grafted to MLA with one RoPE layout for all layers (rope_selection "shared": the
    frequencies with the largest measured contribution over all layers, or "stride"; d_c from
    ``compression``, default 2 since several layers read each shared latent); an all-MLA input with one
    layout is used as it is. Readers are fitted by least squares on the calibration tokens.
    ``compression`` defaults to 4 for MLA.
    """
    from kvgraft.checks import check_device, check_writable
    from kvgraft.hf import load_pretrained, save_pretrained
    from kvgraft.hf.load import load_config, load_tokenizer_dir
    from kvgraft.reference import resolve_model

    # ---- every argument is checked before the weights load or any work starts
    if target is not None and target not in SERVE_TARGETS:
        raise ValueError(f"target {target!r} is not one of {', '.join(SERVE_TARGETS)} (or None)")
    if stock_construction not in STOCK_CONSTRUCTIONS:
        raise ValueError(f"stock_construction {stock_construction!r} is not one of {', '.join(STOCK_CONSTRUCTIONS)}")
    if output_format is None:
        output_format = "deepseek_v3" if target is not None else "kvgraft"
    if target is not None:
        if output_format not in ("deepseek_v3", "both"):
            raise ValueError(f"target {target!r} serves the stock DeepSeek-V3 export; format {output_format!r} writes "
                             "none (use --format deepseek_v3 or both)")
        if to != "mla":
            raise ValueError(f"target {target!r} needs --to mla (vLLM runs the causal encoder-decoder only through "
                             "kvgraft's own engine)")
        if stock_construction != "engines":
            raise ValueError(f"target {target!r} needs stock_construction 'engines': vLLM loads no attention bias, so "
                             "the 'transformers' construction would silently serve another model")
        from kvgraft.hf.engines import VLLM_PREFERRED

        want_c, want_r = VLLM_PREFERRED
        for name, value, want in (("kv_lora_rank", kv_lora_rank, want_c), ("qk_rope_head_dim", qk_rope_head_dim, want_r)):
            if value is not None and value != want:
                raise ValueError(f"target {target!r} sets {name} to {want} (vLLM's CPU backends and FlashMLA-class "
                                 f"kernels cache d_c + d_rope = 512 + 64); got {value}: drop it or drop --target")
        if compression is not None:
            raise ValueError(f"target {target!r} fixes the ranks at {want_c} + {want_r}; --compression {compression} "
                             "contradicts it: drop one")
    if output_format not in FORMATS:
        raise ValueError(f"format {output_format!r} is not one of {', '.join(FORMATS)}")
    if to not in TARGETS:
        raise ValueError(f"target {to!r} is not one of {', '.join(TARGETS)}")
    stock = output_format in ("deepseek_v3", "both")
    if to == "ced":
        if output_format != "kvgraft":
            raise ValueError(f"a causal encoder-decoder is written in kvgraft's format only, not {output_format!r}")
        if rope_selection == "norm":
            raise ValueError("rope_selection 'norm' picks frequencies per layer; the shared RoPE keys of --to ced "
                             "need one layout ('shared', 'stride' or 'auto')")
        if objective == "weights":
            raise ValueError("--to ced fits the readers on calibration text; objective 'weights' has none")
        for name, value in (("sliding_window", sliding_window), ("compress_rate", compress_rate)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be a positive integer")
    for name, value in (("calibration_tokens", calibration_tokens), ("calibration_seq_len", calibration_seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} ({value!r}) must be a positive integer")
    check_device(device)
    src = resolve_model(model)
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    check_writable(out, what="output directory")
    config = load_config(src)  # config.json only: the weights load once everything else is known to be right
    if target is not None:
        from kvgraft.hf.engines import vllm_shape_problem

        problem = vllm_shape_problem(config.kv_width, config.head_dim)
        if problem:
            raise ValueError(f"--target {target}: {problem}")
        from kvgraft.hf.engines import vllm_rope_problem

        problem = vllm_rope_problem(config.rope.rope_type)
        if problem:
            raise ValueError(f"--target {target}: {problem}; --format deepseek_v3 without --target writes the export "
                             "exactly for transformers (with this warning)")
        kv_lora_rank, qk_rope_head_dim = VLLM_PREFERRED
    seq_len = min(calibration_seq_len, config.max_position_embeddings)
    if calibration_tokens < seq_len and objective != "weights":
        raise ValueError(f"calibration_tokens ({calibration_tokens}) must be at least one calibration sequence "
                         f"({seq_len} tokens)")
    already_mla = to == "ced" and set(config.attention_kinds) == {"mla"}  # skip the MLA step
    if already_mla:
        d_rope, d_c = config.qk_rope_head_dim, config.kv_lora_rank
        rank_notes: tuple[str, ...] = ()
    else:
        ranks = default_ranks(config, compression=compression, kv_lora_rank=kv_lora_rank,
                              qk_rope_head_dim=qk_rope_head_dim, stock=stock,
                              stock_layout=rope_selection if rope_selection in ("stride", "prefix")
                              else STOCK_ROPE_SELECTION,
                              default_compression=DEFAULT_CED_COMPRESSION if to == "ced" else DEFAULT_COMPRESSION)
        d_c, d_rope, rank_notes = ranks.kv_lora_rank, ranks.qk_rope_head_dim, ranks.how
        if stock and stock_construction == "transformers" and kv_lora_rank is None and d_c > 1:
            # the stock export pins DeepSeek-V3's latent RMSNorm with one constant latent coordinate
            # (kvgraft.hf.deepseek, latent_norm "pad"): graft one value less so the export caches the budget
            d_c -= 1
            rank_notes = (*rank_notes, (
                f"stock DeepSeek-V3 export: one of the d_c values is a constant coordinate that makes its latent "
                f"RMSNorm exact, so the graft keeps d_c = {d_c} and the export caches {d_c + 1} + {d_rope}"))
    if rope_rotation is None:  # complex measured better for MLA (bench/mla_ood.py); the share graft is unmeasured
        rope_rotation = "real" if to == "ced" else "complex"
    if rope_selection == "auto":  # the best measured ("norm") unless a stock export needs one of its layouts
        rope_selection = STOCK_ROPE_SELECTION if stock else "shared" if to == "ced" else "norm"
    if stock and rope_selection not in ("stride", "prefix"):
        raise ValueError(
            f"rope selection {rope_selection!r} cannot be exported to stock DeepSeek-V3 (--format {output_format}): "
            "its one shared RoPE key rotates each frequency once, in every layer, at theta'^(-2j/d_rope); use "
            "--rope-selection prefix or stride (or auto), or --format kvgraft")
    if rope_selection == "prefix" and d_rope > config.head_dim:
        why = ""
        if stock:
            why = (f" (stock DeepSeek-V3 rotates each frequency once in its one shared RoPE key, so the RoPE parts of "
                   f"{config.num_kv_heads} KV heads cannot all keep their rotation: --rope-dim {config.head_dim} is "
                   "the closest stock export, its measured error printed)")
        raise ValueError(f"rope selection 'prefix' needs d_rope ({d_rope}) <= head_dim ({config.head_dim}): it keeps "
                         f"one rotated head at the d_rope/2 fastest frequencies; pass --rope-dim with an even value <= "
                         f"{config.head_dim} or leave it to the default rule{why}")
    graft = GraftConfig(kv_lora_rank=d_c, qk_rope_head_dim=d_rope, objective=objective,
                        rope_selection=rope_selection, layerwise=layerwise, layers=layers,
                        rope_expectation=rope_expectation and objective != "weights",
                        calibration_shrinkage=calibration_shrinkage, rope_rotation=rope_rotation,
                        # stock DeepSeek-V3 has no per-head q/k norms: the stock export takes their linear fits
                        qk_norm="linearise" if to == "ced" or (stock and config.qk_norm) else "keep")
    if rope_selection == "stride" and (d_rope > config.head_dim or config.head_dim % d_rope):
        divisors = [v for v in range(2, config.head_dim + 1, 2) if config.head_dim % v == 0]
        why = ""
        if stock and d_rope > config.head_dim:
            why = (f" (stock DeepSeek-V3 rotates each frequency once in its one shared RoPE key, so the RoPE parts of "
                   f"{config.num_kv_heads} KV heads cannot all keep their rotation: --rope-dim {config.head_dim} is "
                   "the closest stock export, its measured error printed)")
        raise ValueError(f"rope selection 'stride' needs d_rope ({d_rope}) to divide head_dim ({config.head_dim}); "
                         f"pass --rope-dim with one of {divisors} or leave it to the default rule{why}")
    # the config the graft will produce (its RoPE layout stands in for the one calibration will choose)
    predicted = config
    if not already_mla:
        graft.check_against(config)
        half = config.head_dim // 2
        if rope_selection == "prefix":
            layout = tuple(range(d_rope // 2))
        else:
            layout = tuple(range(0, half, config.head_dim // d_rope)) if config.head_dim % d_rope == 0 \
                else tuple(i % half for i in range(d_rope // 2))  # (wider than a head: pairs from several heads)
        predicted = mla_model_config(config, graft, {i: layout for i in range(config.num_layers)})
    ced_graft = None
    if to == "ced":
        from kvgraft.graft.ced import CEDGraftConfig, default_kv_sources

        sources = default_kv_sources(config.num_layers) if kv_source_layers is None else kv_source_layers
        ced_graft = CEDGraftConfig(kv_source_layers=sources, sliding_window=sliding_window,
                                   compress_rate=compress_rate)
        ced_graft.check_against(predicted)
    if stock:
        from kvgraft.errors import UnsupportedModelError
        from kvgraft.hf.deepseek import config_problems, stock_rope_parameters

        problems = config_problems(predicted)
        if problems:
            raise UnsupportedModelError("cannot export to stock DeepSeek-V3 (--format " + output_format + "): "
                                        + "; ".join(problems) + "; use --format kvgraft")
        stock_rope_parameters(predicted)
    tokenizer = load_tokenizer_dir(src)
    calib = None
    if objective != "weights":
        calib = load_calibration(src, calibration, calibration_tokens, seq_len, tokenizer, config.vocab_size)

    # ---- the work
    t0 = time.perf_counter()
    original = load_pretrained(src, dtype=torch.float32, device=device)  # refuses NaN/Inf weights, naming them
    if stock:
        from kvgraft.hf.deepseek import weight_problems

        problems = weight_problems(original)
        if problems:
            raise UnsupportedModelError("cannot export to stock DeepSeek-V3 (--format " + output_format + "): "
                                        + "; ".join(problems) + "; use --format kvgraft")
    t_load = time.perf_counter() - t0
    t1 = time.perf_counter()
    converted = original if already_mla else graft_mla(original, graft, calib, progress=progress)
    ced_report = None
    if ced_graft is not None:
        from kvgraft.graft.ced import graft_ced

        if not already_mla:
            ced_graft.check_against(converted.config)
        converted, ced_report = graft_ced(converted, ced_graft, calib, progress=progress)
    t_convert = time.perf_counter() - t1
    params = sum(p.numel() for p in original.parameters())
    tail = None
    if calib is not None:  # the calibration tail: what the stock export's error is measured on too
        tail = _tail_figures(original, converted, calib[-TAIL_SEQUENCES:])
    del original  # a 7B model should not be held twice while writing
    record = {
        "source": str(src),
        "to": to,
        "graft": None if already_mla else asdict(graft),
        "ranks_chosen": list(rank_notes),
        "qk_norm_linearised_for_stock_export": bool(stock and config.qk_norm),
        "share_graft": ced_report,
        "kv_cache_bytes_bf16": {str(n): {"original": config.kv_cache_bytes(n, 2),
                                         "converted": converted.config.kv_cache_bytes(n, 2)} for n in (512, 4096)},
        "kv_bytes_per_token_bf16": {"original": config.kv_bytes_per_token(2),
                                    "converted": converted.config.kv_bytes_per_token(2)},
        "compression": config.kv_bytes_per_token(2) / converted.config.kv_bytes_per_token(2),
        "calibration": None if calib is None else {"sequences": calib.shape[0], "seq_len": calib.shape[1],
                                                   "source": str(calibration or src / CALIBRATION)},
        "seconds": {"load": t_load, "convert": t_convert},
        "parameters": {"original": params, "converted": sum(p.numel() for p in converted.parameters())},
        "convert_seconds_per_million_params": t_convert / (params / 1e6),
        "calibration_tail": tail,
        "serve_target": target,
        "stock_construction": stock_construction if stock else None,
        "formats": [],
    }
    with atomic_dir(out, overwrite=overwrite) as tmp:
        tok_dir = src if tokenizer is not None else None
        if output_format in ("kvgraft", "both"):  # the output directory itself is the kvgraft model
            save_pretrained(converted, tmp, tokenizer_dir=tok_dir, model_type="kvgraft", overwrite=True)
            record["formats"].append("kvgraft")
        if output_format in ("deepseek_v3", "both"):
            from kvgraft.hf.deepseek import export_deepseek_v3

            report = export_deepseek_v3(converted, tmp / "deepseek_v3", tokenizer_dir=tok_dir, calibration=calib,
                                        tail_sequences=TAIL_SEQUENCES, verbose=False, target=stock_construction)
            report.path = out / "deepseek_v3"  # where it ends up, not the temporary directory
            record["formats"].append("deepseek_v3")
            record["deepseek_v3"] = report.to_dict()
            stock_bytes = converted.config.num_layers * (report.kv_lora_rank + converted.config.qk_rope_head_dim) * 2
            record["deepseek_v3"]["kv_bytes_per_token_bf16"] = stock_bytes
            record["deepseek_v3"]["compression"] = config.kv_bytes_per_token(2) / stock_bytes
            from kvgraft.hf.engines import engine_support

            record["deepseek_v3"]["engines"] = [e.to_dict() for e in engine_support(
                report.kv_lora_rank, converted.config.qk_rope_head_dim, converted.config.qk_nope_head_dim)]
            if progress:
                print("\n".join(report.summary()), flush=True)
                if tail is not None:
                    print(f"  calibration tail, against the original: perplexity {tail['original_perplexity']:.4g} "
                          f"(original) -> {tail['converted_perplexity']:.4g} (converted; the export adds the error "
                          f"above), max |logit diff| {tail['converted_max_abs_logit_diff_vs_original']:.3g}"
                          + ("; Qwen3's per-head q/k norms are replaced by their least-squares linear fits (stock "
                             "DeepSeek-V3 has no place for them)" if config.qk_norm else ""), flush=True)
        if (src / "eval").is_dir():
            shutil.copytree(src / "eval", tmp / "eval")
        (tmp / "conversion.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record
