"""Stop strings (kvgraft.runtime.stops): one implementation for the engine, the server's text and the CLI."""

from __future__ import annotations

import random

import pytest

from kvgraft.runtime.stops import StopStrings


def brute_find(text: str, stops: tuple[str, ...]) -> int | None:
    cuts = [text.find(s) for s in stops if s in text]
    return min(cuts) if cuts else None


def utf8_decode(pieces: list[bytes], ids: list[int]) -> str:
    """A byte-level detokenizer: an incomplete UTF-8 character at the end decodes as U+FFFD."""
    return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_find_matches_a_full_search_on_growing_and_revised_texts():
    rng = random.Random(0)
    alphabet = "ab\nxé日"
    for _ in range(300):
        stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))})
        m = StopStrings(stops)
        text = ""
        for _ in range(30):
            if rng.random() < 0.1 and text:  # the decoder revised a character somewhere
                i = rng.randrange(len(text))
                text = text[:i] + rng.choice(alphabet) + text[i + 1 :]
            else:
                text += rng.choice(alphabet)
            assert m.find(text) == brute_find(text, stops), (stops, text)


def test_visible_holds_back_only_what_could_begin_a_stop_string():
    m = StopStrings(("\n\nUser:", "END"))
    assert m.visible("hello", False) == "hello"  # nothing there could begin a stop string
    assert m.visible("hello\n", False) == "hello"
    assert m.visible("hello\n\nUs", False) == "hello"
    assert m.visible("hello\n\nUx", False) == "hello\n\nUx"
    assert m.visible("hello E", False) == "hello "
    assert m.visible("hello EN", False) == "hello "
    assert m.visible("hello END and more", False) == "hello "
    assert m.visible("hello\n", True) == "hello\n"  # finished: nothing is held
    assert StopStrings(()).visible("abc\ufffd", False) == "abc"  # an incomplete character waits


def test_stop_string_split_across_tokens_with_multibyte_characters():
    """Tokens that split the stop string and the UTF-8 bytes of its characters: the streamed text never
    shows a part of it, the cut text is the same as a full search gives, and so is the moment it is found."""
    stop = "日本\n"
    text = "価格は千円。日本\nあと"
    raw = text.encode("utf-8")
    rng = random.Random(1)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(raw)), 12))
        pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]
        m, shown, found_at = StopStrings((stop,)), "", None
        for n in range(1, len(pieces) + 1):
            full = utf8_decode(pieces, list(range(n)))
            if found_at is None and m.find(full) is not None:
                found_at = n
            visible = m.visible(full, finished=n == len(pieces))
            assert stop[0] not in visible or visible == "価格は千円。"
            assert "\ufffd" not in visible
            assert visible.startswith(shown)  # never retracts what was shown
            shown = visible
        assert shown == "価格は千円。"
        first = next(n for n in range(1, len(pieces) + 1) if stop in utf8_decode(pieces, list(range(n))))
        assert found_at == first


def test_text_stream_uses_the_shared_stop_strings():
    from kvgraft.serve.streaming import TextStream

    pieces = [p.encode("utf-8") for p in ("Hello", " wor", "ld", "\n", "<", "|user", "|>", "x")]
    ts = TextStream(lambda ids: utf8_decode(pieces, ids), ("\n<|",))
    sent = "".join(ts.delta(list(range(n)), n == len(pieces)) for n in range(1, len(pieces) + 1))
    assert sent == "Hello world"
    assert ts.text(list(range(len(pieces))), True) == "Hello world"


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError):
        StopStrings(("",))


def test_engine_stops_where_a_full_search_of_the_text_first_finds_the_stop_string():
    """Each token decodes to a few UTF-8 bytes (multi-byte characters split across tokens): the engine
    finishes a request at the first step whose decoded output holds the stop string, as searching the
    whole text each step would."""
    import torch

    from kvgraft.model import ModelConfig, Transformer
    from kvgraft.runtime import Engine, SamplingParams
    from kvgraft.runtime.options import EngineOptions

    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(0)
    model.eval()
    raw = "aé日\n本ü".encode()
    pieces = [raw[i % len(raw) : i % len(raw) + 1 + i % 3] for i in range(64)]

    def detok(ids: list[int]) -> str:
        return utf8_decode(pieces, ids)

    prompt = [3, 1, 4, 1, 5]
    free = Engine(model, EngineOptions(max_seqs=1), detokenize=detok).generate(
        [prompt], SamplingParams(max_new_tokens=40, seed=3, temperature=1.0)
    )[0]
    text = [detok(free[:n]) for n in range(1, len(free) + 1)]
    stop = next((t[-2:] for t in text[3:] if len(t) >= 2 and "\ufffd" not in t[-2:]), None)
    assert stop is not None
    want = next(n for n in range(1, len(free) + 1) if stop in text[n - 1])
    got = Engine(model, EngineOptions(max_seqs=1), detokenize=detok).generate(
        [prompt], SamplingParams(max_new_tokens=40, seed=3, temperature=1.0, stop=(stop,))
    )[0]
    assert got == free[:want]


def _tokenizer():
    from kvgraft.hf import load_tokenizer_dir
    from kvgraft.reference import resolve_model

    return load_tokenizer_dir(resolve_model("kvgraft-llama-8m"))


@pytest.mark.parametrize("seed", range(3))
def test_incremental_text_is_the_whole_decode_at_every_step_in_linear_time(seed):
    from kvgraft.runtime.detok import IncrementalText

    tok = _tokenizer()
    text = "Grüße, 世界! naïve café — 🙂 " * 3 + "plain words at the end"
    base = tok.encode(text)
    rng = random.Random(seed)
    ids = base + [rng.randrange(tok.vocab_size) for _ in range(300)]  # and random ids: bytes in any order

    def decode(x):
        return tok.decode(x, skip_special_tokens=True)

    inc = IncrementalText(decode)
    for n in range(1, len(ids) + 1):
        assert inc.text(ids[:n]) == decode(ids[:n]), n
    assert inc.decoded_tokens < 8 * len(ids)  # a window of a few tokens per step, not the whole output


def test_incremental_text_starts_over_on_a_different_list():
    from kvgraft.runtime.detok import IncrementalText

    tok = _tokenizer()

    def decode(x):
        return tok.decode(x, skip_special_tokens=True)

    inc = IncrementalText(decode)
    a, b = tok.encode("first answer"), tok.encode("another one")
    assert inc.text(a) == decode(a)
    assert inc.text(b) == decode(b)


def test_the_engine_decodes_a_window_per_step_not_the_whole_output():
    """Stop strings cost time linear in the output: the ids handed to ``detokenize`` over a 120-token request
    stay a few per step (decoding the whole output every step would hand over about 7,000)."""
    import torch

    from kvgraft.model import ModelConfig, Transformer
    from kvgraft.runtime import Engine, EngineOptions, SamplingParams

    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=160,
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(0)
    model.eval()
    handed = []

    def detok(ids: list[int]) -> str:
        handed.append(len(ids))
        return "".join(chr(65 + i % 26) for i in ids)

    out = Engine(model, EngineOptions(max_seqs=1), detokenize=detok).generate(
        [[1, 2, 3]], SamplingParams(max_new_tokens=120, stop=("never appears",))
    )[0]
    assert len(out) == 120
    assert sum(handed) < 4 * len(out)
