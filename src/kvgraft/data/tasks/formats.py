"""How a task example becomes tokens: the ``plain`` format and the ``chat`` format (a model's chat template).

``plain`` (the reference models', unchanged): ``enc(prompt) + enc(answer) + [eos]``, as
:func:`~kvgraft.data.tasks.encode_example` makes it.

``chat`` (an instruction-tuned model's own format): the prompt is one user message rendered by the tokenizer's
chat template with the generation prompt (``apply_chat_template([{"role": "user", "content": prompt}],
add_generation_prompt=True)``, encoded without adding special tokens, as transformers encodes a rendered
template), and the answer is the assistant's reply: its text (leading whitespace dropped: a reply starts
right after the generation prompt, as the template renders an assistant message) followed by the template's
**end-of-turn token**, the first special token the template writes after an assistant message's content
(``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3, ``<end_of_turn>`` for Gemma), found by rendering a
conversation, not hard-coded. The loss covers the answer and the end-of-turn token only; greedy answers stop
at it.

``auto``: chat when the tokenizer has a chat template, plain otherwise (the shipped reference models have
none, so they keep the plain format).

:class:`TaskEncoding` is the one object the trainer, the evaluator and the task generators use, so all three
count and encode the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvgraft.checks import check_int
from kvgraft.data.tasks.common import IGNORE_INDEX, Example, TaskError, _encode, encode_example, tokenizer_eos_id
from kvgraft.errors import ConfigError

PROMPT_FORMATS: tuple[str, ...] = ("plain", "chat", "auto")
"""The accepted ``--prompt-format`` values (``auto`` resolves to one of the other two)."""

_USER = "KVGRAFTUSERMESSAGE"
_REPLY = "KVGRAFTASSISTANTREPLY"


def check_prompt_format(value: object, what: str = "prompt format") -> str:
    """``value`` when it is one of :data:`PROMPT_FORMATS`; :class:`TaskError` naming it and them otherwise."""
    if not isinstance(value, str) or value not in PROMPT_FORMATS:
        raise TaskError(f"{what} {value!r} is not one of {', '.join(PROMPT_FORMATS)}")
    return value


def chat_template_of(tokenizer: Any) -> str | None:
    """The tokenizer's chat template (a transformers tokenizer's ``chat_template``), or None without one
    (a ``tokenizers.Tokenizer`` never has one)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    return template if isinstance(template, str) and template.strip() else None


def resolve_prompt_format(value: object, tokenizer: Any, where: str = "the tokenizer") -> str:
    """``plain`` or ``chat`` for a requested format (``auto``: chat when ``tokenizer`` has a chat template).

    :class:`TaskError` for an unknown value, or ``chat`` for a tokenizer without a template (``where`` names it
    in the message, e.g. the model directory)."""
    fmt = check_prompt_format(value)
    has = chat_template_of(tokenizer) is not None and hasattr(tokenizer, "apply_chat_template")
    if fmt == "auto":
        return "chat" if has else "plain"
    if fmt == "chat" and not has:
        raise TaskError(
            f"prompt format 'chat' needs a chat template, and {where} has none (no chat_template in "
            "tokenizer_config.json, no chat_template.jinja); use --prompt-format plain (or auto: chat only "
            "where there is a template)"
        )
    return fmt


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    if not isinstance(text, str):
        raise TaskError(f"the chat template rendered {type(text).__name__}, not text")
    return text


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(added, dict):
        ids |= {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
    return ids


@dataclass(frozen=True)
class ChatFormat:
    """What the chat template writes around one user message and one assistant reply.

    ``prefix`` + prompt + ``suffix`` is the rendered prompt (``suffix`` ends with the generation prompt);
    ``reply_prefix`` is what the template writes between the generation prompt and the reply's text (empty for
    ChatML); ``end_of_turn``/``end_of_turn_id`` the token that closes the reply."""

    prefix: str
    suffix: str
    reply_prefix: str
    end_of_turn: str
    end_of_turn_id: int

    @classmethod
    def of(cls, tokenizer: Any, where: str = "the tokenizer") -> ChatFormat:
        """Read the template by rendering placeholder messages; :class:`TaskError` when it has none, does not
        render the user's message verbatim, or writes no special token after a reply."""
        if chat_template_of(tokenizer) is None or not hasattr(tokenizer, "apply_chat_template"):
            resolve_prompt_format("chat", tokenizer, where)  # raises with the accepted values
        user = [{"role": "user", "content": _USER}]
        prompt = _render(tokenizer, user, True)
        if prompt.count(_USER) != 1:
            raise TaskError(f"the chat template of {where} does not render a user message verbatim: {prompt!r}")
        prefix, suffix = prompt.split(_USER)
        full = _render(tokenizer, user + [{"role": "assistant", "content": _REPLY}], False)
        if not full.startswith(prompt) or full.count(_REPLY) != 1:
            raise TaskError(
                f"the chat template of {where} renders a conversation that does not continue its generation "
                f"prompt ({prompt!r} then {full!r}); cannot place the reply"
            )
        reply_prefix, tail = full[len(prompt) :].split(_REPLY)
        specials = _special_ids(tokenizer)
        tail_ids = _encode(tokenizer, tail)
        eot = next((i for i in tail_ids if i in specials), None)
        if eot is None:
            raise TaskError(
                f"the chat template of {where} writes no special token after an assistant reply (it writes "
                f"{tail!r}); cannot tell where a reply ends"
            )
        token = tokenizer.convert_ids_to_tokens(eot) if hasattr(tokenizer, "convert_ids_to_tokens") else str(eot)
        return cls(prefix, suffix, reply_prefix, str(token), int(eot))


class TaskEncoding:
    """Examples as token ids in one prompt format (``plain``, ``chat`` or ``auto``, resolved for ``tokenizer``).

    ``encode(ex, max_len)`` gives ``(input_ids, labels)`` (labels -100 on the prompt); ``prompt_ids`` the
    prompt a model answers, ``answer_ids`` the reply it learns (with its EOS or end-of-turn), ``stop_ids``
    the tokens that end a greedy answer. In the plain format all of these are today's encoding, bit for bit
    (:func:`~kvgraft.data.tasks.encode_example`)."""

    def __init__(self, tokenizer: Any, prompt_format: str = "plain", where: str = "the tokenizer") -> None:
        self.tokenizer = tokenizer
        self.format = resolve_prompt_format(prompt_format, tokenizer, where)
        self.chat = ChatFormat.of(tokenizer, where) if self.format == "chat" else None
        eos = tokenizer_eos_id(tokenizer)
        if self.chat is not None:
            self.end_id: int | None = self.chat.end_of_turn_id
        else:
            self.end_id = eos
        stops = [i for i in (self.end_id, eos) if i is not None]
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))

    def describe(self) -> dict[str, Any]:
        """The format as ``task.json`` and a run's result record it."""
        d: dict[str, Any] = {"prompt_format": self.format}
        if self.chat is not None:
            d["end_of_turn"] = self.chat.end_of_turn
            d["counted"] = "chat template (one user message + generation prompt) + answer + end-of-turn"
        else:
            d["counted"] = "prompt + answer + EOS"
        return d

    def prompt_text(self, prompt: str) -> str:
        """The prompt as the model reads it (rendered by the chat template in the chat format)."""
        if self.chat is None:
            return prompt
        return _render(self.tokenizer, [{"role": "user", "content": prompt}], True)

    def answer_text(self, answer: str) -> str:
        """The reply's text before its end token (chat: the template's reply prefix + the answer, leading
        whitespace dropped)."""
        if self.chat is None:
            return answer
        return self.chat.reply_prefix + answer.lstrip()

    def prompt_ids(self, prompt: str) -> list[int]:
        return _encode(self.tokenizer, self.prompt_text(prompt))

    def answer_ids(self, answer: str) -> list[int]:
        """The reply's tokens and its end token (EOS in the plain format, when the tokenizer has one)."""
        ids = _encode(self.tokenizer, self.answer_text(answer))
        return ids + ([self.end_id] if self.end_id is not None else [])

    def encode(self, ex: Example, max_len: int) -> tuple[list[int], list[int]]:
        if self.chat is None:
            return encode_example(self.tokenizer, ex, max_len)
        check_int("max_len", max_len, low=1)
        prompt = self.prompt_ids(ex.prompt)
        answer = self.answer_ids(ex.answer)
        if len(answer) < 2:
            raise ConfigError("the example's answer encodes to no tokens")
        if len(prompt) + len(answer) > max_len:
            raise ConfigError(
                f"example is {len(prompt) + len(answer)} tokens ({len(prompt)} chat prompt + {len(answer) - 1} "
                f"answer + end-of-turn), longer than max_len={max_len}"
            )
        return prompt + answer, [IGNORE_INDEX] * len(prompt) + answer

    def lengths(self, examples: Sequence[Example]) -> list[int]:
        """Tokens per example in this encoding, end token included."""
        return [len(self.encode(e, 10**9)[0]) for e in examples]

    def cut_at_stop(self, ids: Sequence[int]) -> list[int]:
        """Generated ids up to (not including) the first stop token."""
        out = list(ids)
        for n, i in enumerate(out):
            if i in self.stop_ids:
                return out[:n]
        return out


__all__ = ["PROMPT_FORMATS", "ChatFormat", "TaskEncoding", "chat_template_of", "check_prompt_format", "resolve_prompt_format"]
