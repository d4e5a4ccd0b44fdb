"""Where the layer-by-layer executor stages an output (``.<out>.partial`` beside it), and the check, made
before any work, that a staging directory left by an interrupted conversion is not discarded silently.
The plan checks it (:mod:`kvgraft.graft.plan`); the checkpoint lives there (:mod:`kvgraft.graft.resume`)."""

from __future__ import annotations

from pathlib import Path


def staging_path(out: str | Path) -> Path:
    """Where the layer-by-layer executor stages ``out``: ``.<name>.partial`` beside it."""
    out = Path(out)
    return out.with_name(f".{out.name}.partial")


def check_staging(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse, before any work, a staging directory left by an interrupted conversion unless it is to be
    resumed (``resume``) or discarded (``overwrite``)."""
    staging = staging_path(out)
    if staging.exists() and not resume and not overwrite:
        raise FileExistsError(
            f"{staging} holds an interrupted conversion to {out}: pass --resume to continue it (with the same "
            "options), or --overwrite to discard it and start over"
        )
