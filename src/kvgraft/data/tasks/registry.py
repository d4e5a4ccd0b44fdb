"""The task registry: name -> :class:`~kvgraft.data.tasks.common.TaskSpec` (generator, summary, file format,
answer extraction, correctness), and the functions that dispatch through it: :func:`generate_task`,
:func:`write_task`, :func:`extract_answer`, :func:`is_correct`, :func:`accuracy`.

A new task family is a module next to :mod:`~kvgraft.data.tasks.geometry` that defines a ``SPEC``, listed
in :data:`_SPECS` below (the order of :data:`TASKS`, as ``kvgraft tasks --list`` shows them). Adding one
changes no other task's output: each task draws from its own ``random.Random`` seeded with
``"kvgraft-task:<name>:<seed>"``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvgraft.data.tasks.common import (
    GENERATOR_VERSION,
    SPLITS,
    Example,
    TaskError,
    TaskSpec,
    _check_seed,
    _check_sizes,
    _summary,
    _write_splits,
    token_stats,
)
from kvgraft.data.tasks.geometry import SPEC as _GEOMETRY
from kvgraft.data.tasks.recall import SPEC as _RECALL
from kvgraft.data.tasks.ui_reply import SPEC as _UI_REPLY
from kvgraft.errors import ConfigError

_SPECS: tuple[TaskSpec, ...] = (_GEOMETRY, _UI_REPLY, _RECALL)
REGISTRY: Mapping[str, TaskSpec] = MappingProxyType({spec.name: spec for spec in _SPECS})
"""Every task by name, in the order of :data:`TASKS`."""
TASKS: tuple[str, ...] = tuple(REGISTRY)
TASK_SUMMARIES: Mapping[str, str] = {spec.name: spec.summary for spec in _SPECS}
SIZED_TASKS: tuple[str, ...] = tuple(spec.name for spec in _SPECS if spec.sized_generator is not None)
"""The tasks that can be sized for another model (a token budget; recall: a window too)."""
_FORMATS: Mapping[str, Mapping[str, Any]] = {spec.name: spec.format for spec in _SPECS}


def get_task(name: object) -> TaskSpec:
    """The registered task called ``name``; :class:`TaskError` naming the known ones otherwise."""
    if not isinstance(name, str) or name not in REGISTRY:
        raise TaskError(f"unknown task {name!r} (known: {', '.join(TASKS)})")
    return REGISTRY[name]


def _check_name(name: object) -> str:
    return get_task(name).name


# --------------------------------------------------------------------------- generation


def generate_task(
    name: str, seed: int = 0, *, sizes: Mapping[str, int] | None = None, sizing: Any = None
) -> dict[str, list[Example]]:
    """The task's splits ``{"train": [...], "validation": [...], "test": [...]}``.

    ``sizes`` defaults to :data:`~kvgraft.data.tasks.SPLIT_SIZES` (1,472 / 224 / 601); smaller ones are
    for quick runs (the examples differ from the default's, since the split is a shuffle of all of them).
    Deterministic in ``(name, seed, sizes)``; prompts are unique across all splits. ui-reply and recall
    measure their examples with the shipped reference tokenizer
    (:func:`~kvgraft.data.tasks.reference_tokenizer_file`). Raises :class:`TaskError` for an unknown name,
    ``TypeError``/``ValueError`` for a seed that is not an int >= 0 or bad sizes.

    ``sizing`` (a :class:`~kvgraft.data.tasks.sizing.TaskSizing`, None: the reference models' sizing): the
    token budget, the window (recall) and the encoding they are counted in, for another model; only the
    tasks in :data:`SIZED_TASKS` take one (:class:`TaskError` otherwise).
    """
    spec = get_task(name)
    _check_seed(seed)
    counts = _check_sizes(sizes)
    rng = random.Random(f"kvgraft-task:{name}:{seed}")
    if sizing is None:
        make = spec.generator()
    elif spec.sized_generator is None:
        raise TaskError(
            f"{name} has no token budget or distance to size for a model (accepted: the tasks "
            f"{', '.join(SIZED_TASKS)}; {name} needs no --window, --max-tokens or --prompt-format)"
        )
    else:
        make = spec.sized_generator(sizing)

    total = sum(counts.values())
    seen: set[str] = set()
    examples: list[Example] = []
    attempts = 0
    while len(examples) < total:
        attempts += 1
        if attempts > 50 * total + 1000:  # a generator's space is too small for the split sizes
            raise TaskError(f"{name}: only {len(examples)} distinct examples after {attempts} draws; ask for fewer than {total}")
        ex = make(rng)
        if ex.prompt in seen:
            continue
        seen.add(ex.prompt)
        examples.append(ex)
    rng.shuffle(examples)
    out: dict[str, list[Example]] = {}
    start = 0
    for split in SPLITS:
        out[split] = examples[start : start + counts[split]]
        start += counts[split]
    return out


# --------------------------------------------------------------------------- files


def write_task(
    name: str,
    out_dir: str | Path,
    seed: int = 0,
    *,
    tokenizer: Any = None,
    tokenizer_name: str | None = None,
    overwrite: bool = False,
    sizes: Mapping[str, int] | None = None,
    sizing: Any = None,
) -> Path:
    """Generate a task and write ``train.jsonl``, ``validation.jsonl``, ``test.jsonl`` and ``task.json``.

    The directory appears complete or not at all (built next to ``out_dir`` and renamed). An existing
    ``out_dir`` is refused (``FileExistsError``) unless it is empty or ``overwrite`` is set. With a
    ``tokenizer``, ``task.json`` records token statistics (:func:`~kvgraft.data.tasks.token_stats`) under
    ``"tokens"``, with ``tokenizer_name`` as its source. ``sizes`` and ``sizing`` as in :func:`generate_task`;
    with a ``sizing``, ``task.json`` records it (tokenizer, prompt format, window, budget; recall: the
    distances measured in that encoding) and the token statistics are counted in that encoding, every token
    included (``tokenizer`` is then not used). Returns ``out_dir``.
    """
    spec = get_task(name)
    _check_seed(seed)
    _check_sizes(sizes)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    replace = overwrite or (out.is_dir() and not any(out.iterdir()))
    if out.exists() and not replace:
        raise FileExistsError(f"{out} already exists and is not empty; overwrite (--overwrite) replaces it")
    splits = generate_task(name, seed, sizes=sizes, sizing=sizing)
    info: dict[str, Any] = {
        "name": name,
        "seed": seed,
        "generator_version": GENERATOR_VERSION,
        "sizes": {s: len(splits[s]) for s in SPLITS},
        "format": spec.format,
    }
    if sizing is not None:
        assert spec.sized_info is not None  # generate_task refused a task without a sized generator
        info.update(spec.sized_info(sizing, splits))
        lengths = {s: sizing.encoding.lengths(splits[s]) for s in SPLITS}
        info["tokens"] = {
            "tokenizer": sizing.tokenizer_name,
            "counted": sizing.encoding.describe()["counted"],
            "splits": {s: _summary(lengths[s]) for s in SPLITS},
            "all": _summary([n for s in SPLITS for n in lengths[s]]),
        }
    elif spec.info is not None:  # a token budget, say
        info.update(spec.info())
    if tokenizer is not None and sizing is None:
        info["tokens"] = {"tokenizer": tokenizer_name, "counted": "prompt + answer, no EOS", **token_stats(tokenizer, splits)}
    _write_splits(out, splits, info, overwrite=replace)
    return out


# --------------------------------------------------------------------------- scoring


def extract_answer(name: str, text: str) -> str | None:
    """The checkable answer in generated text, or None when there is none.

    geometry: the number after the last ``=`` of the first line. ui-reply: the canonical JSON of the last
    complete ```json block (or, without one, of the text from the first ``{`` to the last ``}``),
    None if it does not parse. recall: the first 4-digit number of the first line.
    """
    return get_task(name).extract(text)


def is_correct(name: str, example: Example, generated_text: str) -> bool:
    """Whether ``generated_text`` (the model's continuation of ``example.prompt``; a copy of the prompt in
    front is ignored) gets the example right.

    geometry: the final number (after the last ``=``) is within 1e-2 relative of the target. ui-reply: the
    reply's JSON parses and its canonical form equals the target exactly. recall: the first 4-digit number
    of the reply's first line equals the target.
    """
    text = generated_text[len(example.prompt) :] if generated_text.startswith(example.prompt) else generated_text
    spec = get_task(name)
    got = spec.extract(text)
    if got is None:
        return False
    return spec.correct(got, example.target)


def accuracy(name: str, examples: Sequence[Example], generated: Iterable[str]) -> float:
    """Fraction of ``examples`` that :func:`is_correct` accepts (``generated`` in the same order)."""
    outputs = list(generated)
    if len(outputs) != len(examples):
        raise ConfigError(f"{len(examples)} examples but {len(outputs)} generated texts")
    if not examples:
        return 0.0
    return sum(is_correct(name, e, g) for e, g in zip(examples, outputs)) / len(examples)
