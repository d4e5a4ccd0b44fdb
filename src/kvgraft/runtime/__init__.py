"""The runtime: the continuous-batching engine over the paged cache, without HTTP (``kvgraft.serve`` is the HTTP side).

Modules: :mod:`~kvgraft.runtime.engine` (``Engine``: the public API, composing the parts below), :mod:`~kvgraft.runtime.options`
(``EngineOptions``: its sizes, budget and features),
:mod:`~kvgraft.runtime.sampling` (``SamplingParams``, the sampler), :mod:`~kvgraft.runtime.prefix` (the
prefix cache and the replay rule), :mod:`~kvgraft.runtime.adapters` (the adapter registry and
``MultiLoraLinear``), :mod:`~kvgraft.runtime.generate` (``generate``: a batch of equal-length prompts).
The runtime imports the model floor, ``kvgraft.adapters``, ``kvgraft.errors`` and ``kvgraft.atomic`` only.
"""

from kvgraft.runtime.engine import Engine, StepOutput
from kvgraft.runtime.generate import generate
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams

__all__ = ["Engine", "EngineOptions", "SamplingParams", "StepOutput", "generate"]
