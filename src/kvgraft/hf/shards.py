"""Checkpoints tensor by tensor: a lazy reader over (sharded) safetensors and a writer that fills shards as
tensors arrive, so a model larger than memory can be read, and written, one layer at a time.

``CheckpointReader`` opens every shard memory-mapped (``safetensors.safe_open``) and reads a tensor only
when asked for it by name; nothing else is resident. ``ShardWriter`` keeps at most one shard's worth of
tensors (``max_shard_bytes``) in memory, writes each full shard to disk, and at ``close()`` names the shards
as transformers does (``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``, or one
``model.safetensors`` when everything fit in one shard). Write into a directory made by
``kvgraft.atomic.atomic_dir`` so that a crash leaves no half-written checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kvgraft.checks import check_int
from kvgraft.errors import CheckpointError, ConfigError
from kvgraft.hf.load import WEIGHTS, WEIGHTS_INDEX, _checkpoint_dir, _read_json, _shard_files

CHUNK_BYTES = 64 * 2**20  # a cast tensor larger than this is read in chunks of rows of this size (CheckpointReader.get)
_ST_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
DEFAULT_SHARD_BYTES = 4 * 2**30  # transformers' save_pretrained default ("5GB") rounded down to a power of two


class CheckpointReader:
    """Tensors of a checkpoint directory read one at a time, by name (file names, e.g. ``model.norm.weight``).

    Use as a context manager (or call ``close()``): the shards stay memory-mapped while it is open. ``get``
    copies the tensor out of the map (so the caller owns it) in the requested dtype and device."""

    def __init__(self, path: str | Path) -> None:
        self.directory = _checkpoint_dir(path)
        self._shards: list[Path] = []
        self._handles: list[Any] = []  # None: unmapped (release), mapped again when read
        self._where: dict[str, int] = {}
        try:
            for shard in _shard_files(self.directory):
                handle = self._open(shard)
                index = len(self._handles)
                self._shards.append(shard)
                self._handles.append(handle)
                for key in handle.keys():
                    if key in self._where:
                        raise CheckpointError(f"{shard} repeats tensor {key} already read from another shard")
                    self._where[key] = index
        except BaseException:
            self.close()
            raise
        index_path = self.directory / WEIGHTS_INDEX
        if not (self.directory / WEIGHTS).is_file() and index_path.is_file():
            absent = sorted(set(_read_json(index_path)["weight_map"]) - set(self._where))
            if absent:
                raise CheckpointError(f"tensors listed in {index_path} are in none of its shards: {absent}")

    def keys(self) -> list[str]:
        """Every tensor name, in file order (shard by shard)."""
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, read from the header (no data is read)."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        """The tensor ``name`` (cast to ``dtype`` if given); ``CheckpointError`` names a missing one.

        A tensor larger than ``CHUNK_BYTES`` that is cast is read ``CHUNK_BYTES`` of rows at a time into the
        cast result, its file pages unmapped after each chunk: reading it whole and casting held the mapped
        pages, the file-dtype copy and the result at once (a 128k x 2048 bf16 embedding: 0.5 + 0.5 + 1 GB).
        The values are the same (the cast is elementwise)."""
        handle = self._handle(name)
        view = handle.get_slice(name)
        shape = tuple(view.get_shape())
        file_bytes = _ST_BYTES.get(view.get_dtype(), 4) * math.prod(shape)
        if dtype is None or len(shape) == 0 or file_bytes <= CHUNK_BYTES:
            tensor = handle.get_tensor(name)
            if dtype is not None and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            return tensor.to(device)
        del view
        out = torch.empty(shape, dtype=dtype)
        rows = max(1, CHUNK_BYTES * shape[0] // file_bytes)
        index = self._where[name]
        for start in range(0, shape[0], rows):
            chunk = self._open(self._shards[index]).get_slice(name)[start : start + rows]  # mapped for this chunk only
            out[start : start + rows].copy_(chunk)
            del chunk
        self._handles[index] = None  # the handle used for the header is unmapped too
        return out.to(device)

    def prefixed(self, prefix: str) -> Iterator[str]:
        """The names that start with ``prefix`` (e.g. ``model.layers.3.``), in file order."""
        return (k for k in self._where if k.startswith(prefix))

    @staticmethod
    def _open(shard: Path) -> Any:
        try:
            return safe_open(str(shard), framework="pt", device="cpu")
        except SafetensorError as exc:
            raise CheckpointError(f"{shard} is not a valid safetensors file (truncated or corrupt?): {exc}") from exc

    def _handle(self, name: str) -> Any:
        if name not in self._where:
            raise CheckpointError(f"{self.directory} has no tensor {name}")
        index = self._where[name]
        if self._handles[index] is None:
            self._handles[index] = self._open(self._shards[index])
        return self._handles[index]

    def release(self) -> None:
        """Unmap the shards; the next ``get`` maps its shard again. The pages of a memory-mapped file that
        were read count in this process's resident memory while it stays mapped: a reader walking a large
        checkpoint calls this after each layer so that they do not add up (the tensors it returned stay)."""
        self._handles = [None] * len(self._handles)

    def close(self) -> None:
        self._handles.clear()  # safe_open handles unmap when collected

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


# safetensors' dtype names, in the order of its Rust Dtype enum (save_file writes larger ones first)
_ST_DTYPES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
}
_ST_ORDER = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"]


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (CPU) as ``safetensors.torch.save_file`` does, byte for byte, without its in-memory copy
    of the whole file: the header, then each tensor's bytes straight from its memory. ``save_file`` builds the
    file as one bytes object first, which doubles a shard's memory while it is written (2 x 2.1 GB for an 8B
    model's fp32 embedding). Shared or non-contiguous tensors are refused as ``save_file`` refuses them."""
    names = sorted(tensors, key=lambda k: (-_ST_ORDER.index(_ST_DTYPES[tensors[k].dtype]), k))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name in names:
        t = tensors[name]
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ConfigError(f"tensor {name} must be a contiguous CPU tensor")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as handle:
        handle.write(len(blob).to_bytes(8, "little"))
        handle.write(blob)
        for name in names:
            t = tensors[name]
            if t.numel():
                handle.write(t.reshape(-1).view(torch.uint8).numpy().data)  # a view of the tensor, no copy


class ShardWriter:
    """Collect tensors into shards of at most ``max_shard_bytes`` (a tensor larger than that gets a shard of its
    own), writing each shard as soon as it is full; ``close()`` writes the last one and names them.

    Tensors are copied to CPU, made contiguous, and never kept past their shard's write. Names must be unique.
    ``close()`` returns the ``weight_map`` (name -> file)."""

    def __init__(
        self, directory: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES, metadata: dict[str, str] | None = None
    ) -> None:
        check_int("max_shard_bytes", max_shard_bytes, low=1)
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory} is not a directory (ShardWriter writes into an existing one)")
        self.max_shard_bytes = max_shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()
        self.total_bytes = 0
        self.peak_pending_bytes = 0
        self.seconds = 0.0  # spent writing shards
        self._closed = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("ShardWriter is closed")
        if name in self._names:
            raise ConfigError(f"tensor {name} was already written")
        t = tensor.detach().to("cpu").contiguous()
        if any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in self._pending.values()):
            t = t.clone()  # safetensors refuses tensors that share memory
        size = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = t
        self._names.add(name)
        self._pending_bytes += size
        self.total_bytes += size
        self.peak_pending_bytes = max(self.peak_pending_bytes, self._pending_bytes)
        if self._pending_bytes >= self.max_shard_bytes and size:  # full: written now, not at the next add
            self._flush()  # (the same shards: the next tensor would not have fit) e.g. a 2 GB embedding freed at once

    def add_all(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.add(name, tensor)

    def _flush(self) -> None:
        t0 = time.perf_counter()
        path = self.directory / f".shard-{len(self._written):05d}.safetensors"
        write_safetensors(path, self._pending, self.metadata)
        self.seconds += time.perf_counter() - t0
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def state(self) -> dict[str, Any]:
        """What ``restore`` needs to continue this writer in another process (JSON-ready): the shards written
        (file names in ``directory``, tensor names) and the counters. The pending tensors are ``pending``."""
        return {
            "written": [[path.name, names] for path, names in self._written],
            "pending": list(self._pending),
            "total_bytes": self.total_bytes,
            "peak_pending_bytes": self.peak_pending_bytes,
            "seconds": self.seconds,
        }

    @property
    def pending(self) -> dict[str, torch.Tensor]:
        """The tensors added since the last shard was written (in order; not copies)."""
        return dict(self._pending)

    def restore(self, state: dict[str, Any], pending: dict[str, torch.Tensor]) -> None:
        """Continue the writer whose ``state()`` was ``state`` and whose pending tensors were ``pending``: its
        shards must still be in ``directory``. Only a fresh writer (nothing added) can be restored."""
        if self._names or self._written or self._closed:
            raise RuntimeError("only a fresh ShardWriter can be restored")
        written = [(self.directory / name, list(names)) for name, names in state["written"]]
        missing = [str(path) for path, _ in written if not path.is_file()]
        if missing:
            raise CheckpointError(f"cannot continue writing: shards {missing} are gone")
        if list(pending) != list(state["pending"]):
            raise CheckpointError("cannot continue writing: the pending tensors are not the ones recorded")
        self._written = written
        self._pending = {k: v.contiguous() for k, v in pending.items()}
        self._pending_bytes = sum(t.numel() * t.element_size() for t in self._pending.values())
        self._names = {n for _, names in written for n in names} | set(self._pending)
        self.total_bytes = int(state["total_bytes"])
        self.peak_pending_bytes = int(state["peak_pending_bytes"])
        self.seconds = float(state["seconds"])

    def close(self) -> dict[str, str]:
        """Write what is pending, give the shards their final names, write the index; the weight map."""
        if self._closed:
            raise RuntimeError("ShardWriter is closed")
        if self._pending or not self._written:
            self._flush()
        self._closed = True
        n = len(self._written)
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(self._written):
            final = WEIGHTS if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return weight_map


__all__ = ["DEFAULT_SHARD_BYTES", "CheckpointReader", "ShardWriter", "write_safetensors"]
