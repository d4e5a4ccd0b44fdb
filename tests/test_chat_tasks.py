"""Tasks sized for a given model and the chat prompt format (kvgraft.data.tasks.sizing / .formats, adapt's
--prompt-format): distances counted in the encoding actually trained on, labels on the answer and the
end-of-turn token only, the template's prompt as apply_chat_template renders it, the plain format and the
reference sizing unchanged, clear errors. With a tiny tokenizer and chat template built here, and with the real
SmolLM2 tokenizer when it has been fetched (skipped otherwise)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvgraft.cli import main
from kvgraft.data import tasks as T
from kvgraft.data.tasks import Example, TaskError
from kvgraft.data.tasks.formats import TaskEncoding
from kvgraft.data.tasks.sizing import TaskSizing, load_sizing
from kvgraft.reference import fetch_command, fetched_model_dir, reference_model_dir

TINY = {"train": 12, "validation": 3, "test": 3}
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REAL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tiny():
    """A byte-level BPE of 400 tokens trained here on task-like text, with ChatML's special tokens and template."""
    from tokenizers import pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvgraft.data.tasks.recall import ADJECTIVES, ANIMALS
    from kvgraft.data.tokenizer import new_tokenizer

    tok = new_tokenizer()
    text = ["Ledger of codes:\n" + "".join(f"{a} {b}: {i:04d}\n" for i, (a, b) in enumerate(zip(ADJECTIVES, ANIMALS)))]
    text += ["Question: what is the code of amber fox?\nAnswer: User: Build a form Assistant: Here is"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(text * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    got = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(got["input_ids"] if hasattr(got, "keys") else got)


def _distance(tokenizer, ex: Example) -> int:
    """Tokens from the end of the queried line to the end of the chat prompt, by the tokenizer itself."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": ex.prompt}], add_generation_prompt=True, tokenize=False)
    end = text.index(f": {ex.target}\n") + len(f": {ex.target}\n")
    full = tokenizer.encode(text, add_special_tokens=False)
    head = tokenizer.encode(text[:end], add_special_tokens=False)
    assert full[: len(head)] == head  # the line's end is a token boundary
    return len(full) - len(head)


def _check_chat_example(tokenizer, enc: TaskEncoding, ex: Example, eot: str) -> None:
    ids, labels = enc.encode(ex, 10**6)
    prompt = _chat_ids(tokenizer, ex.prompt)
    assert ids[: len(prompt)] == prompt  # the prompt is apply_chat_template's, generation prompt included
    text = tokenizer.apply_chat_template([{"role": "user", "content": ex.prompt}], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(prompt) == text
    answer = tokenizer.encode(ex.answer.lstrip(), add_special_tokens=False)
    assert ids[len(prompt) :] == answer + [tokenizer.convert_tokens_to_ids(eot)]  # the reply, then end-of-turn
    assert labels == [-100] * len(prompt) + ids[len(prompt) :]  # the loss: answer and end-of-turn only
    assert tokenizer.decode(ids[len(prompt) :]) == ex.answer.lstrip() + eot


# --------------------------------------------------------------------------- the tiny tokenizer and template


def test_chat_encoding_with_a_tiny_template(tiny):
    enc = TaskEncoding(tiny, "auto")
    assert enc.format == "chat" and enc.chat.end_of_turn == "<|im_end|>"
    assert enc.stop_ids == (tiny.convert_tokens_to_ids("<|im_end|>"), tiny.convert_tokens_to_ids("<|endoftext|>"))
    ex = Example("Question: what is the code of amber fox?\nAnswer:", " 0042", "0042", "recall")
    _check_chat_example(tiny, enc, ex, "<|im_end|>")
    assert enc.cut_at_stop([5, 6, enc.stop_ids[0], 7]) == [5, 6]
    plain = TaskEncoding(tiny, "plain")  # the plain format: today's encoding, bit for bit
    assert plain.encode(ex, 10**6) == T.encode_example(tiny, ex, 10**6)
    with pytest.raises(ValueError, match="longer than max_len=5"):
        enc.encode(ex, 5)


def test_sized_recall_in_the_chat_format_keeps_the_line_beyond_the_window(tiny):
    sizing = TaskSizing(TaskEncoding(tiny, "chat"), "tiny", window=24, max_tokens=300)
    splits = T.generate_task("recall", 0, sizes=TINY, sizing=sizing)
    examples = [e for s in T.SPLITS for e in splits[s]]
    distances = [_distance(tiny, e) for e in examples]
    assert min(distances) >= 24 + 32 and max(distances) > 24 + 32
    assert all(len(sizing.encoding.encode(e, 10**6)[0]) <= 300 for e in examples)
    assert distances == [T.encoded_recall_distance(sizing.encoding, e) for e in examples]
    _check_chat_example(tiny, sizing.encoding, examples[0], "<|im_end|>")
    ui = T.generate_task("ui-reply", 0, sizes=TINY, sizing=TaskSizing(TaskEncoding(tiny, "chat"), "tiny", max_tokens=900))
    assert all(len(sizing.encoding.encode(e, 10**6)[0]) <= 900 for s in T.SPLITS for e in ui[s])


def test_the_reference_sizing_spelled_out_draws_todays_examples():
    """Sized with the reference tokenizer, the plain format, window 64 and 500 tokens: today's output."""
    sizing = load_sizing(None, window=64, max_tokens=500, prompt_format="auto")
    assert sizing.prompt_format == "plain"  # the reference tokenizer has no chat template
    assert T.generate_task("recall", 0, sizes=TINY, sizing=sizing) == T.generate_task("recall", 0, sizes=TINY)
    ui = load_sizing(None, max_tokens=500, prompt_format="plain")
    assert T.generate_task("ui-reply", 3, sizes=TINY, sizing=ui) == T.generate_task("ui-reply", 3, sizes=TINY)


def test_bad_sizing_is_refused_naming_the_value(tmp_path, tiny):
    for bad in (0, -128, True, "128", 1.5):
        with pytest.raises(TaskError, match=rf"window {bad!r} is not accepted: a positive number of tokens"):
            load_sizing(None, window=bad)
    with pytest.raises(TaskError, match="max_tokens 0 is not accepted"):
        load_sizing(None, max_tokens=0)
    with pytest.raises(TaskError, match="prompt format 'xml' is not one of plain, chat, auto"):
        load_sizing(None, prompt_format="xml")
    missing = tmp_path / "no" / "model"
    with pytest.raises(
        TaskError, match=rf"tokenizer '{missing}': no such directory \(accepted: a model directory holding tokenizer.json"
    ):
        load_sizing(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match="holds no tokenizer.json"):
        load_sizing(tmp_path / "empty")
    with pytest.raises(TaskError, match="prompt format 'chat' needs a chat template, and kvgraft-ced-8m has none"):
        load_sizing("kvgraft-ced-8m", prompt_format="chat")
    small = TaskSizing(TaskEncoding(tiny, "chat"), "tiny", window=400, max_tokens=300)
    with pytest.raises(TaskError, match=r"recall: window 400 .* max_tokens 300 leaves no room"):
        T.generate_task("recall", 0, sizes=TINY, sizing=small)
    with pytest.raises(TaskError, match="ui-reply has no distance to size: window 64 applies to recall only"):
        T.generate_task("ui-reply", 0, sizes=TINY, sizing=TaskSizing(TaskEncoding(tiny, "chat"), "tiny", window=64))
    with pytest.raises(TaskError, match="geometry has no token budget or distance to size"):
        T.generate_task("geometry", 0, sizes=TINY, sizing=TaskSizing(TaskEncoding(tiny, "chat"), "tiny"))


def test_cli_tasks_sized_and_its_errors(tmp_path, capsys, monkeypatch):
    from kvgraft.data.tasks import common

    monkeypatch.setattr(common, "SPLIT_SIZES", TINY)  # the command writes full splits; small ones here
    ref = reference_model_dir()
    out = tmp_path / "recall"
    assert main(["tasks", "recall", "--out", str(out), "--window", "64", "--tokenizer", str(ref)]) == 0
    text = capsys.readouterr().out
    assert "plain format, at most 500 tokens, window 64" in text and "at least 96 (window 64 + 32)" in text
    info = T.read_task_info(out)
    assert info["sizing"]["prompt_format"] == "plain" and info["distance"]["measured"]["min"] >= 96
    assert info["tokens"]["counted"] == "prompt + answer + EOS"
    assert T.load_task(out) == T.generate_task("recall", 0, sizes=TINY)  # today's examples
    for args, message in (
        (["recall", "--window", "0"], "window 0 is not accepted: a positive number of tokens"),
        (["geometry", "--window", "64"], "size the tasks ui-reply, recall; geometry has no token budget"),
        (["ui-reply", "--window", "128"], "ui-reply has no distance to size: window 128 applies to recall only"),
        (["recall", "--window", "128", "--tokenizer", str(tmp_path / "nowhere")], "no such directory"),
        (["recall", "--prompt-format", "chat"], "prompt format 'chat' needs a chat template"),
    ):
        assert main(["tasks", *args, "--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- adapt and the study in the chat format


@pytest.fixture(scope="module")
def chat_base(tmp_path_factory) -> Path:
    """kvgraft-ced-8m with a chat template (its one special token closes a turn), weights linked, not copied."""
    src = reference_model_dir("kvgraft-ced-8m")
    base = tmp_path_factory.mktemp("chat") / "ced-chat"
    base.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(src / name, base / name)
    (base / "model.safetensors").symlink_to(src / "model.safetensors")
    template = CHATML.replace("<|im_start|>", "<|endoftext|>").replace("<|im_end|>", "<|endoftext|>")
    (base / "chat_template.jinja").write_text(template)
    return base


def test_adapt_in_the_chat_format_records_it_and_refuses_to_mix(chat_base, tmp_path, capsys):
    from kvgraft.train.adapt import AdaptConfig, adapt
    from kvgraft.train.experiment import study_format

    fast = dict(steps=1, micro_batch_size=2, warmup_steps=0, val_examples=2, test_examples=2, accuracy_examples=2, progress=False)
    r = adapt(chat_base, "geometry", tmp_path / "run", AdaptConfig(**fast))  # auto: the base has a template
    assert r["config"]["prompt_format"] == "chat" and r["encoding"]["end_of_turn"] == "<|endoftext|>"
    assert 0 <= r["test_accuracy"] <= 1
    meta = json.loads((tmp_path / "run" / "adapter" / "kvgraft_adapter.json").read_text())
    assert meta["training"]["prompt_format"] == "chat"
    assert adapt(chat_base, "geometry", tmp_path / "run", AdaptConfig(prompt_format="chat", **fast)) == r
    with pytest.raises(
        ValueError, match="finished run with another configuration \\(prompt_format 'chat' there, 'plain' here\\)"
    ):
        adapt(chat_base, "geometry", tmp_path / "run", AdaptConfig(prompt_format="plain", **fast))
    # an interrupted run is never resumed in another format
    state = tmp_path / "cut" / "checkpoints" / "step_00000001"
    state.mkdir(parents=True)
    (state / "state.json").write_text(json.dumps({"step": 1, "adapt_config": {"prompt_format": "plain"}}))
    with pytest.raises(
        ValueError, match="interrupted run with another prompt format or task sizing \\(prompt_format 'plain' there, 'chat' here"
    ):
        adapt(chat_base, "geometry", tmp_path / "cut", AdaptConfig(**fast))
    # validation before any work
    with pytest.raises(ValueError, match="prompt_format 'xml' is not one of plain, chat, auto"):
        AdaptConfig(prompt_format="xml")
    with pytest.raises(ValueError, match="prompt format 'chat' needs a chat template"):
        adapt("kvgraft-ced-8m", "geometry", tmp_path / "no", AdaptConfig(prompt_format="chat", **fast), dry_run=True)
    with pytest.raises(ValueError, match="--window 128 applies to recall only"):
        adapt(chat_base, "ui-reply", tmp_path / "no", AdaptConfig(task_window=128, **fast), dry_run=True)
    with pytest.raises(ValueError, match="geometry has no token budget or distance to size"):
        adapt(chat_base, "geometry", tmp_path / "no", AdaptConfig(task_window=128, **fast), dry_run=True)
    assert adapt("kvgraft-ced-8m", "recall", tmp_path / "no", AdaptConfig(**fast), dry_run=True)["prompt_format"] == "plain"
    assert not (tmp_path / "no").exists()
    # the study records its format and refuses to continue in another
    assert study_format(chat_base, "recall", tmp_path / "study", "auto", None, None) == "chat"
    assert json.loads((tmp_path / "study" / "study_config.json").read_text())["prompt_format"] == "chat"
    with pytest.raises(
        ValueError, match="study with another prompt format or task sizing \\(prompt_format 'chat' there, 'plain' here\\)"
    ):
        study_format(chat_base, "recall", tmp_path / "study", "plain", None, None)
    assert main(["experiment", "placement", "--base", str(chat_base), "--task", "recall", "--out", str(tmp_path / "study"),
                 "--prompt-format", "chat", "--window", "96", "--lr", "1e-3"]) == 2  # fmt: skip
    assert "task_window None there, 96 here" in capsys.readouterr().err


def test_a_task_directory_sized_in_another_format_is_refused(chat_base, tmp_path):
    from kvgraft.train.adapt import AdaptConfig, adapt

    sizing = load_sizing(chat_base, window=64, prompt_format="chat")
    T.write_task("recall", tmp_path / "task", sizes=TINY, sizing=sizing)
    fast = dict(steps=1, micro_batch_size=2, val_examples=2, test_examples=2, accuracy_examples=0, progress=False)
    with pytest.raises(ValueError, match="sized in the 'chat' prompt format \\(its task.json\\) and this run uses 'plain'"):
        adapt(chat_base, tmp_path / "task", tmp_path / "run", AdaptConfig(prompt_format="plain", **fast))
    with pytest.raises(ValueError, match="the task directory .* was sized when it was written"):
        adapt(chat_base, tmp_path / "task", tmp_path / "run", AdaptConfig(task_window=64, **fast), dry_run=True)


# --------------------------------------------------------------------------- the real model's tokenizer


@pytest.fixture(scope="module")
def real():
    path = fetched_model_dir(REAL)
    if path is None:
        pytest.skip(f"{REAL} is not fetched: run `make real-model` ({fetch_command(REAL)})")
    return path


def test_smollm2_recall_and_ui_reply_in_its_chat_format(real):
    sizing = load_sizing(real, window=128)
    assert sizing.prompt_format == "chat" and sizing.encoding.chat.end_of_turn == "<|im_end|>"
    tok = sizing.encoding.tokenizer
    splits = T.generate_task("recall", 0, sizes=TINY, sizing=sizing)
    examples = [e for s in T.SPLITS for e in splits[s]]
    assert min(_distance(tok, e) for e in examples) >= 128 + 32
    assert all(len(sizing.encoding.encode(e, 10**6)[0]) <= 500 for e in examples)
    for e in examples[:3]:
        _check_chat_example(tok, sizing.encoding, e, "<|im_end|>")
    ui = T.generate_task("ui-reply", 0, sizes=TINY, sizing=load_sizing(real))
    for e in ui["test"]:
        _check_chat_example(tok, sizing.encoding, e, "<|im_end|>")
        assert len(sizing.encoding.encode(e, 10**6)[0]) <= 500
    plain = TaskEncoding(tok, "plain")
    assert plain.encode(examples[0], 10**6) == T.encode_example(tok, examples[0], 10**6)
