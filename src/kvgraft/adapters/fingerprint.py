"""Which base an adapter belongs to: a cheap fingerprint of the base's weights, and a portable reference.

An adapter is only meaningful on the exact weights it was trained on. ``kvgraft_adapter.json`` records:

- ``base_fingerprint``: a hash of the base's config (architecture only; what the serving path checks);
- ``base``: ``{"name", "reference" | "path", "fingerprint", "sample"}``. ``name`` is a shipped reference
  model's name (``"reference": true``: resolved by ``kvgraft.reference.resolve_model`` on any machine, under
  ``KVGRAFT_MODELS_DIR`` or the repository's ``models/``) or, for any other base, its directory name with
  ``path``, the base's location relative to the adapter directory (so an adapter moved together with its
  base still finds it). No absolute path of the training machine is recorded.

``fingerprint`` hashes the config fingerprint, every tensor's name and shape, and a strided sample of the
values: at most ``PER_TENSOR`` evenly spaced values of each tensor and ``SAMPLE_BUDGET`` in all (a 7B
checkpoint: ~300 tensors, 4,096 values read, no pass over the weights), rounded to bf16 so that the same
checkpoint loaded in fp32 or bf16 gives the same hash. ``sample`` keeps those values (base64 of their bf16
bits, 8 kB at most): when the hashes differ only because the base was loaded in another precision (fp16
from an fp32 checkpoint rounds twice), every sampled value still agrees within ``TOLERANCE`` (two bf16
steps) and the base is accepted; any other difference refuses the adapter, naming both fingerprints.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvgraft.errors import CheckpointError, ConfigError
from kvgraft.reference import reference_model_dir

PER_TENSOR = 32  # sampled values per tensor, at most
SAMPLE_BUDGET = 4096  # sampled values in all, at most (fewer per tensor, or every k-th tensor, beyond)
TOLERANCE = 2.0**-7  # relative: two bf16 steps, what loading in another precision can move a value


def base_fingerprint(config) -> str:
    """A hash of the base config (the architecture): an adapter refuses a base it was not trained on. The
    weights are fingerprinted too (:func:`weights_sample`, checked by ``load_adapter``)."""
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def _base_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The base's tensors by name, sorted; PEFT's LoRA layers (if the model carries some) are left out and
    their wrapped ``base_layer`` weights named as the plain model names them."""
    out = {}
    for name, t in model.state_dict().items():
        if "lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = t
    return sorted(out.items())


def _positions(n: int, k: int) -> list[int]:
    """``k`` evenly spaced positions in ``range(n)`` (integer arithmetic: the same on every machine)."""
    k = min(k, n)
    return [((2 * i + 1) * n) // (2 * k) for i in range(k)]


@torch.no_grad()
def weights_sample(model) -> tuple[str, torch.Tensor]:
    """(hash of the names, shapes and the sample; the sample as bf16 values on the CPU)."""
    tensors = _base_tensors(model)
    h = hashlib.sha256(base_fingerprint(model.config).encode())
    for name, t in tensors:
        h.update(f"{name}:{tuple(t.shape)};".encode())
    n = len(tensors)
    chosen = set(_positions(n, SAMPLE_BUDGET)) if n > SAMPLE_BUDGET else set(range(n))
    per = max(1, min(PER_TENSOR, SAMPLE_BUDGET // max(1, len(chosen))))
    parts = []
    for i, (_, t) in enumerate(tensors):
        if i not in chosen or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        idx = torch.tensor(_positions(flat.numel(), per), device=flat.device)
        parts.append(flat.index_select(0, idx).to("cpu", torch.float32))
    sample = (torch.cat(parts) if parts else torch.zeros(0)).to(torch.bfloat16)
    h.update(_bits(sample))
    return h.hexdigest()[:16], sample


def _bits(sample: torch.Tensor) -> bytes:
    return sample.view(torch.int16).numpy().astype("<i2").tobytes()


def _from_bits(data: str) -> torch.Tensor:
    raw = np.frombuffer(base64.b64decode(data), dtype="<i2").astype(np.int16)
    return torch.from_numpy(raw.copy()).view(torch.bfloat16)


def base_record(model) -> dict[str, Any]:
    """What an adapter records of its base's weights: ``fingerprint`` and ``sample``."""
    fingerprint, sample = weights_sample(model)
    return {"fingerprint": fingerprint, "sample": base64.b64encode(_bits(sample)).decode("ascii")}


def _describe(meta: dict) -> str:
    base = meta.get("base")
    if isinstance(base, dict) and base.get("name"):
        return f"{base['name']!r}"
    if isinstance(base, str):
        return f"{base!r}"
    return "its base"


def check_base_weights(meta: dict, model, adapter_dir: str | Path) -> bool:
    """Raise ValueError (naming both fingerprints) when ``model`` is not the base recorded in ``meta``.
    Returns False when ``meta`` records no weights fingerprint (an adapter written before it existed), True
    when the weights were checked."""
    base = meta.get("base")
    if not isinstance(base, dict) or "fingerprint" not in base:
        return False
    mine, sample = weights_sample(model)
    if mine == base["fingerprint"]:
        return True
    theirs = _from_bits(base["sample"]) if base.get("sample") else None
    if theirs is not None and theirs.shape == sample.shape:
        a, b = theirs.float(), sample.float()
        close = (a - b).abs() <= TOLERANCE * torch.maximum(a.abs(), b.abs()) + 6e-8  # fp16's smallest step
        if bool(close.all()):
            return True  # the same weights in another precision: the hash saw their rounding only
    raise ConfigError(
        f"adapter {adapter_dir} was trained on another base model: its base {_describe(meta)} has "
        f"fingerprint {base['fingerprint']}, this model has {mine} (same architecture, other weights); "
        "load it on the model it was trained on"
    )


def base_reference(base_path: str | Path, adapter_dir: str | Path) -> dict[str, Any]:
    """How an adapter written to ``adapter_dir`` names its base at ``base_path``, without absolute paths:
    a shipped reference model by name, any other base by its path relative to the adapter directory."""

    path = Path(base_path).resolve()
    try:
        if reference_model_dir(path.name).resolve() == path:
            return {"name": path.name, "reference": True}
    except CheckpointError:
        pass
    try:
        rel = os.path.relpath(path, Path(adapter_dir).resolve())
    except ValueError:  # another drive (Windows): no relative path exists
        return {"name": path.name}
    return {"name": path.name, "path": Path(rel).as_posix()}


def relocate_reference(meta: dict, from_dir: str | Path, to_dir: str | Path) -> dict:
    """``meta`` for a copy of the adapter at ``from_dir`` written to ``to_dir`` (its relative base path
    re-based), unchanged when the base is a reference name."""
    base = meta.get("base")
    if not isinstance(base, dict) or "path" not in base:
        return meta
    where = (Path(from_dir) / base["path"]).resolve()
    kept = {k: v for k, v in base.items() if k not in ("name", "path", "reference")}
    return dict(meta, base=base_reference(where, to_dir) | kept)


def resolve_base(adapter_dir: str | Path, meta: dict) -> Path:
    """The base model directory an adapter records, on this machine; FileNotFoundError saying what was tried
    (give the base explicitly then). An old adapter's absolute path is used if it exists, with a warning."""

    base = meta.get("base")
    tried = []
    if isinstance(base, dict):
        if base.get("reference"):
            try:
                return reference_model_dir(base["name"])
            except CheckpointError as exc:
                tried.append(str(exc))
        if base.get("path"):
            where = Path(adapter_dir) / base["path"]
            if (where / "config.json").is_file():
                return where
            tried.append(f"{base['path']} relative to the adapter ({where}) holds no config.json")
        named = f"base {base['name']!r}" if base.get("name") else "a base it does not name"
        what = f"{named} (fingerprint {base.get('fingerprint')})"
    elif isinstance(base, str) and base:
        if (Path(base) / "config.json").is_file():
            warnings.warn(
                f"adapter {adapter_dir} records its base as the path {base} (written by an older kvgraft): "
                "save it again to record a portable reference",
                stacklevel=2,
            )
            return Path(base)
        what, tried = f"base {base!r}", [f"{base} does not exist here"]
    else:
        what = "no base"
    raise FileNotFoundError(
        f"adapter {adapter_dir} records {what}, not found on this machine "
        f"({'; '.join(tried) or 'nothing to resolve'}); give the base model explicitly"
    )
