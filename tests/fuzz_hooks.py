"""Schemathesis hooks for tests/test_server_fuzz.py (loaded through ``SCHEMATHESIS_HOOKS=fuzz_hooks``).

One limit of the server cannot be stated in JSON Schema: a prompt's length in tokens against the context
(the schema bounds token-id prompts, but a text prompt's token count depends on the tokenizer, and a chat's
on every message together). The fuzz keeps generated requests within it, and only it: a body whose text
would take more than ``KVGRAFT_FUZZ_MAX_PROMPT_BYTES`` UTF-8 bytes once rendered is not sent. Bytes bound
tokens from above for a byte-level BPE tokenizer (every token covers at least one byte), so nothing sent is
refused for its length (a few bodies that would fit are dropped too). Nothing else is filtered, and the
checks are schemathesis' own defaults, unchanged.
"""

from __future__ import annotations

import os

import schemathesis

LIMIT = int(os.environ.get("KVGRAFT_FUZZ_MAX_PROMPT_BYTES", "0"))


def _bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _text(content) -> str:
    parts = content if isinstance(content, list) else [content]
    return "".join(
        p if isinstance(p, str) else p.get("text", "") if isinstance(p, dict) and isinstance(p.get("text"), str) else ""
        for p in parts
    )


def rendered_bytes(body: dict) -> int | None:
    """An upper bound of the rendered prompt's UTF-8 bytes (kvgraft.serve.server.render_chat's template for
    chats), or None when the body holds no text prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _bytes(prompt)
    messages = body.get("messages")
    if isinstance(messages, list):
        total = _bytes("<|assistant|>\n")
        for m in messages:
            if isinstance(m, dict):
                total += _bytes(f"<|{m.get('role')}|>\n{_text(m.get('content'))}\n")
        return total
    return None


@schemathesis.hook
def filter_body(context, body) -> bool:
    if not LIMIT or not isinstance(body, dict):
        return True
    n = rendered_bytes(body)
    return n is None or n <= LIMIT
