"""Where the shipped reference models live.

They sit in the repository's ``models/`` directory (next to ``src/``). ``KVGRAFT_MODELS_DIR``
points elsewhere (e.g. an installed copy of that directory).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvgraft.errors import CheckpointError

DEFAULT_MODEL = "kvgraft-llama-8m"


def models_dir() -> Path:
    env = os.environ.get("KVGRAFT_MODELS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "models"


def reference_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Directory of a shipped reference model; CheckpointError listing what is shipped if absent."""
    root = models_dir()
    path = root / name
    if not (path / "config.json").is_file():
        shipped = sorted(p.name for p in root.glob("*") if (p / "config.json").is_file()) if root.is_dir() else []
        raise CheckpointError(
            f"reference model {name!r} not found in {root} (shipped: {', '.join(shipped) or 'none'}); "
            "set KVGRAFT_MODELS_DIR to the directory that holds the reference models"
        )
    return path


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A path as given, or the name of a shipped reference model, or the default one for None."""
    if model is None:
        return reference_model_dir()
    path = Path(model)
    if path.exists() or os.sep in str(model):
        return path
    return reference_model_dir(str(model))
