"""Import a GGUF file (llama.cpp's format, often quantized) as a standard Hugging Face checkpoint.

:func:`import_gguf` reads the file's metadata with the ``gguf`` package first (its architecture, shape and
tensor types; nothing is dequantized yet) and refuses an architecture kvgraft does not run; then transformers'
own GGUF loader dequantizes the weights (undoing llama.cpp's Q/K permutation) and builds the tokenizer and
chat template from the file; the model is cast to ``dtype`` and written with ``save_pretrained`` into a
temporary directory next to ``out_dir``, with a card (README.md) naming the source file, its sha256 and its
quantization, then renamed onto ``out_dir``: a reader never sees half a checkpoint.

The result is not bit-identical to the unquantized original: it holds the quantized model's values.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from gguf import GGUFReader, GGUFValueType
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvgraft.atomic import atomic_dir
from kvgraft.checks import check_text, check_writable
from kvgraft.errors import CheckpointError, ConfigError, UnsupportedModelError
from kvgraft.hf.load import load_config
from kvgraft.hf.save import OutputExistsError

GGUF_MAGIC = b"GGUF"
# the GGUF architectures transformers' GGUF loader reads that kvgraft runs (llama.cpp writes Mistral models as
# "llama"; transformers tells them apart by name and writes model_type "mistral")
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = ("bfloat16", "float16", "float32")
CARD = "README.md"
# keys transformers' tokenizer loading leaves in tokenizer_config.json that describe this machine's load only
_LOAD_ONLY_TOKENIZER_KEYS = ("is_local", "local_files_only")


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file's header says, read without dequantizing anything."""

    path: Path
    architecture: str
    name: str | None
    license: str | None
    tensor_types: dict[str, int]  # GGML type name (F32, F16, Q4_1, Q8_0, ...) -> tensor count
    metadata: dict[str, Any]  # scalar fields (arrays left out), e.g. "llama.block_count"
    has_chat_template: bool


@dataclass(frozen=True)
class ImportReport:
    """What :func:`import_gguf` read and wrote."""

    out_dir: Path
    source: Path
    source_bytes: int
    sha256: str
    architecture: str  # general.architecture in the GGUF
    model_type: str  # model_type of the checkpoint written
    tensor_types: dict[str, int]
    dtype: str
    num_parameters: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    chat_template: bool
    transformers_version: str
    seconds: float
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out_dir"], d["source"] = str(self.out_dir), str(self.source)
        return d

    def format(self) -> str:
        return "\n".join(
            [
                f"kvgraft import-gguf: {self.source.name} -> {self.out_dir}",
                f"  source       {self.source_bytes:,} bytes, sha256 {self.sha256}",
                f"  quantization {format_tensor_types(self.tensor_types)} (dequantized)",
                f"  model        {self.model_type} (GGUF architecture {self.architecture}): {_shape(self)}",
                f"  written      {self.num_parameters:,} parameters in {self.dtype}, "
                f"chat template: {'yes' if self.chat_template else 'no'} ({self.seconds:.1f} s)",
            ]
        )


def format_tensor_types(types: dict[str, int]) -> str:
    """``Q4_1 x 210, F32 x 61, Q8_0 x 1`` (most first)."""
    return ", ".join(f"{name} x {count}" for name, count in sorted(types.items(), key=lambda kv: (-kv[1], kv[0])))


def _shape(r: ImportReport) -> str:
    return (
        f"{r.num_layers} layers, hidden {r.hidden_size}, {r.num_attention_heads} attention heads / "
        f"{r.num_key_value_heads} KV heads of {r.head_dim}, FFN {r.intermediate_size}, vocab {r.vocab_size:,}, "
        f"context {r.max_position_embeddings:,}, {'tied' if r.tie_word_embeddings else 'untied'} embeddings"
    )


def _check_gguf_file(gguf_file: str | os.PathLike[str]) -> Path:
    if not isinstance(gguf_file, (str, os.PathLike)):
        raise TypeError(f"gguf_file must be a path, got {type(gguf_file).__name__}")
    path = Path(gguf_file)
    if not path.exists():
        raise CheckpointError(f"GGUF file {path} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file; expected a .gguf file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise CheckpointError(
            f"{path} is not a GGUF file (its first bytes are {magic!r}; a GGUF file starts with {GGUF_MAGIC!r})"
        )
    return path


def read_gguf_info(gguf_file: str | os.PathLike[str]) -> GGUFInfo:
    """The architecture, scalar metadata and tensor types of a GGUF file (CheckpointError when unreadable)."""
    path = _check_gguf_file(gguf_file)
    try:
        reader = GGUFReader(path)
        metadata: dict[str, Any] = {}
        for key, fld in reader.fields.items():
            if fld.types and fld.types[0] != GGUFValueType.ARRAY:
                metadata[key] = fld.contents()
        tensor_types = Counter(t.tensor_type.name for t in reader.tensors)
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str):
        raise CheckpointError(f"{path} has no general.architecture field; every GGUF model file states one")
    name, license_ = metadata.get("general.name"), metadata.get("general.license")
    return GGUFInfo(
        path=path,
        architecture=architecture,
        name=name if isinstance(name, str) else None,
        license=license_ if isinstance(license_, str) else None,
        tensor_types=dict(tensor_types),
        metadata=metadata,
        has_chat_template=isinstance(metadata.get("tokenizer.chat_template"), str),
    )


def _check_supported(info: GGUFInfo) -> None:
    if info.architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{info.path.name}: GGUF architecture {info.architecture!r} is not supported; kvgraft imports "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (the Llama-family models it runs)"
        )
    splits = info.metadata.get("split.count")
    if isinstance(splits, int) and splits > 1:
        raise UnsupportedModelError(
            f"{info.path.name} is one of {splits} split GGUF files; merge them first (llama.cpp's gguf-split --merge)"
        )
    if not info.tensor_types:
        raise CheckpointError(f"{info.path.name} holds no tensors (a vocabulary-only GGUF?)")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _log(message: str) -> None:
    print(f"kvgraft import-gguf: {message}", file=sys.stderr, flush=True)


def _card(r: ImportReport, info: GGUFInfo, source_note: str | None) -> str:
    title = info.name or r.source.stem
    quantized = sorted(t for t in r.tensor_types if t not in ("F32", "F64"))
    source_lines = [
        f"- file: `{r.source.name}` ({r.source_bytes:,} bytes)",
        f"- sha256: `{r.sha256}`",
        f"- GGUF architecture: `{r.architecture}`" + (f", general.name `{info.name}`" if info.name else ""),
        f"- tensor types: {format_tensor_types(r.tensor_types)}",
    ]
    if info.license:
        source_lines.append(f"- license (general.license): {info.license}")
    if source_note:
        source_lines.append(f"- from: {source_note}")
    if quantized:
        fidelity = (
            f"The file's {', '.join(quantized)} tensors were dequantized by transformers' GGUF loader, so this "
            "checkpoint holds the quantized model's values: it is **not bit-identical** to the unquantized "
            "original, and its outputs differ from the original release's by the quantization error."
        )
    else:
        fidelity = "The file holds no quantized tensors (F32 only): the weights are the file's."
    if r.dtype != "float32":
        fidelity += f" All weights were then rounded to {r.dtype}."
    return "\n".join(
        [
            f"# {title} (imported from GGUF)",
            "",
            f"A standard Hugging Face checkpoint (`model_type` `{r.model_type}`) written by kvgraft's "
            "`kvgraft import-gguf` (`kvgraft.hf.gguf.import_gguf`) from a GGUF file.",
            "",
            "## Source",
            "",
            *source_lines,
            "",
            "## Written",
            "",
            f"- {_shape(r)}",
            f"- {r.num_parameters:,} parameters in {r.dtype} (dequantized in float32, then cast)",
            f"- tokenizer from the file's vocabulary; chat template: {'yes (chat_template.jinja)' if r.chat_template else 'no'}",
            f"- by transformers {r.transformers_version}'s GGUF loader (which undoes llama.cpp's Q/K permutation)",
            "",
            "## Fidelity",
            "",
            fidelity,
            "",
        ]
    )


def _clean_tokenizer_config(directory: Path) -> None:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    if any(k in config for k in _LOAD_ONLY_TOKENIZER_KEYS):
        for k in _LOAD_ONLY_TOKENIZER_KEYS:
            config.pop(k, None)
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def import_gguf(
    gguf_file: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    source_note: str | None = None,
) -> ImportReport:
    """Import the GGUF model file ``gguf_file`` as a Hugging Face checkpoint at ``out_dir``.

    ``dtype``: bfloat16 (default), float16 or float32 for the weights written (dequantized in float32 first).
    ``overwrite``: replace an existing ``out_dir`` (refused otherwise). ``source_note``: a line for the card
    saying where the file came from. Every argument is checked, and the file's header read, before any
    weight is loaded; the architecture must be one of :data:`SUPPORTED_GGUF_ARCHITECTURES`.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {type(overwrite).__name__}")
    if source_note is not None:
        if not isinstance(source_note, str):
            raise TypeError(f"source_note must be a string, got {type(source_note).__name__}")
        check_text("source_note", source_note)
    source = _check_gguf_file(gguf_file)
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir):
        raise ConfigError(f"out_dir must be a directory path, got {out_dir!r}")
    out = Path(out_dir)
    if out.exists():
        if not overwrite:
            raise OutputExistsError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it")
        if not out.is_dir():
            raise OutputExistsError(f"{out} exists and is not a directory; remove it first")
        if source.resolve().is_relative_to(out.resolve()):
            raise ConfigError(f"{source} lies inside {out}, which overwrite would delete; write elsewhere")
    check_writable(out, what="output directory")
    info = read_gguf_info(source)
    _check_supported(info)

    started = time.perf_counter()
    _log(f"{source.name}: GGUF architecture {info.architecture}, tensors {format_tensor_types(info.tensor_types)}")
    sha256 = _sha256(source)
    source_bytes = source.stat().st_size

    _log("dequantizing with transformers' GGUF loader (float32)")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"transformers could not load {source}: {exc}") from exc
    # the loaded model is marked as quantized (quant_method gguf), which save_pretrained refuses: its weights
    # are plain dequantized tensors now, so drop the marks
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model = model.to(getattr(torch, dtype)).eval()
    num_parameters = sum(p.numel() for p in model.parameters())

    _log(f"writing {out} ({dtype})")
    with atomic_dir(out, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        if not (tmp / "generation_config.json").is_file() and model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _clean_tokenizer_config(tmp)
        load_config(tmp)  # kvgraft runs what it wrote (UnsupportedModelError naming the option otherwise)
        report = ImportReport(
            out_dir=out,
            source=source,
            source_bytes=source_bytes,
            sha256=sha256,
            architecture=info.architecture,
            model_type=str(config.model_type),
            tensor_types=info.tensor_types,
            dtype=dtype,
            num_parameters=num_parameters,
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_attention_heads=int(config.num_attention_heads),
            num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
            intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            max_position_embeddings=int(config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            chat_template=(tmp / "chat_template.jinja").is_file() or bool(getattr(tokenizer, "chat_template", None)),
            transformers_version=transformers.__version__,
            seconds=time.perf_counter() - started,
            files=sorted([p.name for p in tmp.iterdir()] + [CARD]),
        )
        (tmp / CARD).write_text(_card(report, info, source_note), encoding="utf-8")
    return report


__all__ = [
    "DTYPES",
    "GGUFInfo",
    "ImportReport",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "format_tensor_types",
    "import_gguf",
    "read_gguf_info",
]
