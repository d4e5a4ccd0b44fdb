"""State-dict key map between transformers' Llama-family checkpoints and kvgraft's Transformer.

kvgraft's names are transformers' without the ``model.`` prefix (``lm_head.weight`` keeps its name).
Both directions check the state against the shapes ``Transformer(config)`` has (built on the meta device,
:mod:`kvgraft.model.shapes`): every expected key present, every shape right, nothing left over. With
tied embeddings the file carries no ``lm_head.weight``.
"""

from __future__ import annotations

import torch

from kvgraft.errors import CheckpointError
from kvgraft.model.config import ModelConfig
from kvgraft.model.shapes import parameter_shapes

HF_PREFIX = "model."
LM_HEAD = "lm_head.weight"
EMBED = "embed_tokens.weight"
# Buffers old transformers versions saved; they hold no learned state and kvgraft recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """kvgraft key -> shape of ``Transformer(cfg)``'s state (lm_head only when not tied).

    Read off the model itself (:func:`kvgraft.model.shapes.parameter_shapes`), so the check cannot
    disagree with what the runtime builds."""
    return parameter_shapes(cfg)


def check_state(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], source: str) -> None:
    """Raise CheckpointError listing missing, unexpected and mis-shaped keys (names as in ``state``)."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [
        f"{k}: expected {tuple(expected[k])}, found {tuple(state[k].shape)}"
        for k in sorted(set(expected) & set(state))
        if tuple(state[k].shape) != tuple(expected[k])
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong))
    if problems:
        raise CheckpointError(f"{source} does not match its config: " + "; ".join(problems))


def _drop_tied_head(state: dict[str, torch.Tensor], embed_key: str, source: str) -> dict[str, torch.Tensor]:
    """With tied embeddings an lm_head.weight is accepted only if it equals the embedding; it is dropped."""
    head, embed = state.get(LM_HEAD), state.get(embed_key)
    if head is None:
        return state
    same = embed is not None and head.shape == embed.shape and (head is embed or torch.equal(head, embed))
    if not same:
        raise CheckpointError(
            f"{source}: tie_word_embeddings is true but {LM_HEAD} differs from {embed_key}; "
            f"expected no {LM_HEAD} or one equal to {embed_key}"
        )
    return {k: v for k, v in state.items() if k != LM_HEAD}


def _to_hf_name(key: str) -> str:
    return key if key == LM_HEAD else HF_PREFIX + key


def hf_to_kvgraft(state: dict[str, torch.Tensor], cfg: ModelConfig, source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """transformers names -> kvgraft names, checked against ``cfg``. Errors use the file's names."""
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        state = _drop_tied_head(state, HF_PREFIX + EMBED, source)
    expected = {_to_hf_name(k): shape for k, shape in expected_shapes(cfg).items()}
    check_state(state, expected, source)
    return {(k if k == LM_HEAD else k[len(HF_PREFIX) :]): v for k, v in state.items()}


def kvgraft_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, source: str = "model") -> dict[str, torch.Tensor]:
    """kvgraft names -> transformers names; with tied embeddings lm_head is dropped (it is the embedding)."""
    if cfg.tie_word_embeddings:
        state = _drop_tied_head(state, EMBED, source)
    check_state(state, expected_shapes(cfg), source)
    return {_to_hf_name(k): v for k, v in state.items()}
