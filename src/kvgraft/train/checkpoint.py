"""Training checkpoints, written atomically: a checkpoint directory either exists complete or not at all.

Layout: ``out_dir/checkpoints/step_{N:08d}/`` with ``model.safetensors`` (shared tensors such as tied
embeddings stored once), ``optimizer.pt`` (tensors and numbers only; loaded with ``weights_only=True``)
and ``state.json``. The newest complete directory is the one resumed from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from kvgraft.atomic import atomic_dir
from kvgraft.errors import ConfigError

PREFIX = "step_"


def checkpoint_dirs(out_dir: str | Path) -> list[Path]:
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").exists()]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX) :]))


def find_latest(out_dir: str | Path) -> Path | None:
    dirs = checkpoint_dirs(out_dir)
    return dirs[-1] if dirs else None


def save_checkpoint(
    out_dir: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    tokens: int,
    elapsed_s: float,
    keep: int,
    extra: dict[str, Any] | None = None,
    trainable_only: bool = False,
) -> Path:
    """``trainable_only``: store only the parameters that train (an adapter run: the frozen base is not
    copied into every checkpoint; it is loaded from the base model on resume)."""
    target = Path(out_dir) / "checkpoints" / f"{PREFIX}{step:08d}"
    with atomic_dir(target, overwrite=True) as tmp:
        if trainable_only:
            save_file(
                {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad},
                str(tmp / "model.safetensors"),
            )
        else:
            save_model(model, str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        state = {"step": step, "tokens": tokens, "elapsed_s": elapsed_s, "trainable_only": trainable_only, **(extra or {})}
        (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
    for old in checkpoint_dirs(out_dir)[:-keep]:
        shutil.rmtree(old)
    return target


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load weights (strict) and optimizer state from a checkpoint directory; return its state.json.

    A checkpoint whose state.json has ``optimizer_reset`` (the reason) may lack optimizer.pt: the optimizer then
    starts from fresh moments (a weights-only copy carried to another machine)."""
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    if state.get("trainable_only"):
        saved = load_file(str(path / "model.safetensors"))
        params = dict(model.named_parameters())
        want = {n for n, p in params.items() if p.requires_grad}
        if set(saved) != want:
            raise ConfigError(
                f"checkpoint {path} holds trainable parameters {sorted(set(saved) ^ want)[:5]} ... that do not match the model's"
            )
        with torch.no_grad():
            for n, t in saved.items():
                params[n].copy_(t)
    else:
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
        if missing or unexpected:
            raise ConfigError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
    if optimizer is not None:
        if (path / "optimizer.pt").is_file():
            optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        elif not state.get("optimizer_reset"):  # only a checkpoint that says so may restart the moments
            raise FileNotFoundError(
                f"{path / 'optimizer.pt'} is missing; a checkpoint without the optimizer's state must say why in "
                'state.json ("optimizer_reset"), e.g. one unpacked from a weights-only copy'
            )
    return state
