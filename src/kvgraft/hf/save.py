"""Save a kvgraft Transformer as a transformers checkpoint directory, atomically.

The directory (config.json, model.safetensors, generation_config.json, tokenizer files, extra files)
is written into a temporary sibling and renamed into place only when complete, so an interrupted save
leaves nothing behind. transformers' ``AutoModelForCausalLM.from_pretrained`` loads it directly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvgraft.atomic import atomic_dir
from kvgraft.errors import CheckpointError, ConfigError, KvgraftError
from kvgraft.hf.config_map import hf_config_from_model
from kvgraft.hf.keys import kvgraft_to_hf
from kvgraft.hf.load import CONFIG, WEIGHTS
from kvgraft.model.transformer import Transformer

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class OutputExistsError(KvgraftError, FileExistsError):
    """The output directory exists and overwrite was not requested."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _hf_tensors(model: Transformer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's weights under transformers' names: on CPU, in ``dtype``, contiguous, no shared storage."""
    state = kvgraft_to_hf({k: v.detach() for k, v in model.state_dict().items()}, model.config)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        t = tensor.to("cpu", dtype).contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:  # safetensors refuses tensors that share memory
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _json(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def save_pretrained(
    model: Transformer,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    model_type: str = "llama",
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write ``model`` as a transformers ``model_type`` checkpoint at ``out_dir``; return the path."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise OutputExistsError(f"{out_dir} already exists; pass overwrite=True to replace it")
    cfg = model.config
    dtype = dtype or model.embed_tokens.weight.dtype
    hf_config = hf_config_from_model(cfg, model_type, dtype=_dtype_name(dtype))  # validates first
    tokenizer_files = tokenizer_files_of(tokenizer_dir)
    extra_files = dict(extra_files or {})
    reserved = {CONFIG, WEIGHTS, GENERATION_CONFIG, *(p.name for p in tokenizer_files)}
    for name in extra_files:
        if Path(name).name != name or name in reserved or name.startswith("."):
            raise ConfigError(f"extra file name {name!r} must be a plain file name other than {sorted(reserved)}")
    tensors = _hf_tensors(model, dtype)
    write_checkpoint_dir(out_dir, hf_config, tensors, cfg, tokenizer_files, extra_files, overwrite)
    return out_dir


def write_checkpoint_dir(
    out_dir: Path,
    config_json: dict,
    tensors: dict[str, torch.Tensor],
    cfg,
    tokenizer_files: list[Path],
    extra_files: dict[str, str],
    overwrite: bool,
) -> None:
    """Write config.json, model.safetensors, generation_config.json, tokenizer and extra files atomically."""
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        write_side_files(tmp, config_json, cfg, tokenizer_files, extra_files)


def tokenizer_files_of(tokenizer_dir: str | Path | None) -> list[Path]:
    """The tokenizer files of ``tokenizer_dir`` that a checkpoint carries (none for None); CheckpointError
    when the directory has none of them."""
    if tokenizer_dir is None:
        return []
    tokenizer_dir = Path(tokenizer_dir)
    files = [tokenizer_dir / n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file()]
    if not files:
        raise CheckpointError(f"tokenizer directory {tokenizer_dir} has none of {', '.join(TOKENIZER_FILES)}")
    return files


def write_side_files(
    directory: Path, config_json: dict, cfg, tokenizer_files: list[Path], extra_files: dict[str, str] | None = None
) -> None:
    """Everything of a checkpoint directory but its weights: config.json, generation_config.json, the
    tokenizer and extra files (``write_checkpoint_dir``; the layer-by-layer converter writes its weights
    through ``kvgraft.hf.shards.ShardWriter``)."""
    generation = {"_from_model_config": True, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    if cfg.pad_token_id is not None:
        generation["pad_token_id"] = cfg.pad_token_id
    (directory / CONFIG).write_text(_json(config_json), encoding="utf-8")
    (directory / GENERATION_CONFIG).write_text(_json(generation), encoding="utf-8")
    for src in tokenizer_files:
        shutil.copyfile(src, directory / src.name)
    for name, text in (extra_files or {}).items():
        (directory / name).write_text(text, encoding="utf-8")
