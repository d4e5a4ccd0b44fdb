"""Synthetic fine-tuning tasks (kvgraft.data.tasks): determinism, splits, right answers, lengths, files, CLI."""

from __future__ import annotations

import ast
import json
import math
import operator
import re

import pytest

from kvgraft.cli import main
from kvgraft.data import tasks as T
from kvgraft.data.tasks import Example, TaskError
from kvgraft.data.tokenizer import load_tokenizer
from kvgraft.reference import reference_model_dir

SMALL = {"train": 30, "validation": 5, "test": 5}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(reference_model_dir())


FULL = ("geometry", "ui-reply")  # generated whole once per run; recall is tested on its own below


@pytest.fixture(scope="module")
def data():
    return {name: T.generate_task(name, 0) for name in FULL}


@pytest.fixture(scope="module")
def counts(data):
    """Reference-tokenizer tokens (prompt + answer, no EOS) of every example, per task, by the generator's
    exact counter (the tokenizer's pieces, cached; test_budget_counter_agrees_with_the_tokenizer checks it
    against the tokenizer itself), which is several times faster than encoding everything again."""
    count = T._reference_counter()
    return {name: [count(e.prompt) + count(e.answer) for e in _all(data[name])] for name in FULL}


def _all(splits):
    return [e for split in T.SPLITS for e in splits[split]]


# --------------------------------------------------------------------------- splits and determinism


@pytest.mark.parametrize("name", FULL)
def test_exact_split_sizes_and_no_prompt_in_two_splits(data, name):
    splits = data[name]
    assert {s: len(splits[s]) for s in T.SPLITS} == {"train": 1472, "validation": 224, "test": 601}
    prompts = [e.prompt for e in _all(splits)]
    assert len(set(prompts)) == len(prompts)
    assert all(isinstance(e, Example) and e.prompt and e.answer and e.target and e.kind for e in _all(splits))


@pytest.mark.parametrize("name", T.TASKS)
def test_same_seed_same_data_other_seed_other_data(name):
    a = T.generate_task(name, 7, sizes=SMALL)
    assert a == T.generate_task(name, 7, sizes=SMALL)
    b = T.generate_task(name, 8, sizes=SMALL)
    assert a != b
    assert {e.prompt for e in _all(a)} != {e.prompt for e in _all(b)}


def test_full_geometry_is_deterministic(data):
    assert T.generate_task("geometry", 0) == data["geometry"]


# --------------------------------------------------------------------------- geometry answers

# kind -> the answer from the numbers of the prompt, in order (an independent restatement of the templates)
FORMULAS = {
    "triangle-third": lambda a, b: 180 - a - b,
    "straight-line": lambda a: 180 - a,
    "complementary": lambda a: 90 - a,
    "isosceles-base": lambda a: (180 - a) / 2,
    "isosceles-apex": lambda b: 180 - 2 * b,
    "polygon-sum": lambda n: (n - 2) * 180,
    "regular-interior": lambda n: (n - 2) * 180 / n,
    "regular-exterior": lambda n: 360 / n,
    "hypotenuse": lambda a, b: math.hypot(a, b),
    "leg": lambda c, a: math.sqrt(c * c - a * a),
    "rectangle-area": lambda w, h: w * h,
    "rectangle-perimeter": lambda w, h: 2 * (w + h),
    "triangle-area": lambda b, h: b * h / 2,
    "circle-area": lambda r, pi: pi * r * r,
    "circumference": lambda r, pi: 2 * pi * r,
    "square-area": lambda p: (p / 4) ** 2,
    "triangle-perimeter": lambda a, b, c: a + b + c,
    "similar-side": lambda ab, de, bc: bc * de / ab,
    "scale-factor": lambda a, b: b / a,
}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv, ast.Pow: operator.pow}


def _arith(expr: str) -> float:
    """Value of a + - * / ^ ( ) expression over numbers, via the AST (no eval)."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"not arithmetic: {expr!r}")

    return ev(ast.parse(expr.replace("^", "**"), mode="eval").body)


def test_every_geometry_answer_is_arithmetically_right(data):
    examples = _all(data["geometry"])
    assert {e.kind for e in examples} == set(FORMULAS)
    for e in examples:
        numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", e.prompt)]
        want = FORMULAS[e.kind](*numbers)
        assert math.isclose(float(e.target), want, rel_tol=1e-9), (e, want)
        assert want > 0 and round(want, 2) == pytest.approx(want)
        # every worked step is arithmetic that holds, and the last number is the target
        assert e.answer.startswith(" ") and "\n" not in e.answer
        for step in e.answer.strip().split(", "):
            parts = step.split("=")
            values = [_arith(p) for p in parts if not re.fullmatch(r"[a-z]", p)]
            assert all(math.isclose(v, values[-1], rel_tol=1e-9) for v in values), (e, step)
        assert e.answer.endswith("=" + e.target)
        assert T.is_correct("geometry", e, e.answer)


def test_geometry_scoring():
    e = Example("Q: A rectangle is 5 by 20. Area?\nA:", " 5*20=100", "100", "rectangle-area")
    assert T.is_correct("geometry", e, " 5*20=100")
    assert T.is_correct("geometry", e, e.prompt + " 5*20=100")  # the prompt in front is ignored
    assert T.is_correct("geometry", e, " 5*20=100.5<|endoftext|>Q: 1=2")  # within 1e-2 relative
    assert T.is_correct("geometry", e, " 5*20=100\nQ: something=7")  # only the first line counts
    assert not T.is_correct("geometry", e, " 5*20=102")
    assert not T.is_correct("geometry", e, " 5*20 is a hundred")
    assert T.extract_answer("geometry", " 6^2+8^2=100, c=10") == "10"


# --------------------------------------------------------------------------- ui-reply answers


def _json_block(answer: str) -> str:
    return answer.split("```json\n", 1)[1].split("\n```", 1)[0]


def test_every_ui_reply_json_parses_and_matches_the_request(data):
    for e in _all(data["ui-reply"]):
        spec = json.loads(_json_block(e.answer))
        assert T.canonical_json(spec) == e.target
        assert T.is_correct("ui-reply", e, e.answer)
        assert f'titled "{spec["title"]}"' in e.prompt
        assert T.UI_MIN_COMPONENTS <= len(spec["children"]) <= T.UI_MAX_COMPONENTS
        assert f"{len(spec['children'])} components" in e.answer
        labels = [c["label"] for c in spec["children"] if "label" in c]
        labels += [b["label"] for c in spec["children"] for b in c.get("children", [])]
        assert len(labels) == len(set(labels))
        for label in labels:  # every component was asked for
            assert f'"{label}"' in e.prompt


def test_ui_reply_scoring_rejects_corrupted_answers(data):
    e = data["ui-reply"]["test"][0]
    block = _json_block(e.answer)
    spec = json.loads(block)
    label = spec["children"][0].get("label") or spec["children"][0]["children"][0]["label"]
    wrong_label = e.answer.replace(f'"label": "{label}"', '"label": "Something else"', 1)
    assert wrong_label != e.answer and not T.is_correct("ui-reply", e, wrong_label)
    assert not T.is_correct("ui-reply", e, e.answer.replace(block, block[:-3]))  # truncated: does not parse
    extra = block.replace("}},\n", '}},\n  {"type": "text"},\n', 1)  # one component too many
    assert extra != block and not T.is_correct("ui-reply", e, e.answer.replace(block, extra))
    assert not T.is_correct("ui-reply", e, " Sure, here it is.")
    reordered = dict(spec, children=spec["children"][::-1])
    assert not T.is_correct("ui-reply", e, "```json\n" + json.dumps(reordered) + "\n```")
    # the JSON alone (any key order, any spacing) is enough
    assert T.is_correct("ui-reply", e, json.dumps(spec, indent=4, sort_keys=True))
    assert T.is_correct("ui-reply", e, e.prompt + e.answer)


# --------------------------------------------------------------------------- lengths


def test_token_lengths_and_ratio(counts):
    geo, ui = counts["geometry"], counts["ui-reply"]
    assert 20 <= min(geo) and max(geo) <= 45
    assert max(ui) + 1 <= T.UI_MAX_TOKENS  # + EOS: every ui-reply example fits 500 tokens
    ratio = (sum(ui) / len(ui)) / (sum(geo) / len(geo))
    assert 12 <= ratio <= 30, ratio
    assert 25 <= sum(geo) / len(geo) <= 40


def test_budget_counter_agrees_with_the_tokenizer(data, counts, tok):
    picks = {name: list(range(0, len(counts[name]), 8)) for name in FULL}  # every 8th example
    for name in FULL:
        examples = _all(data[name])
        real = T.token_counts(tok, [examples[i] for i in picks[name]])
        assert real == [counts[name][i] for i in picks[name]]
    tricky = [
        "foo \nbar",
        "a  b",
        "it's here, they'll go",
        "x\n\n  y",
        "tabs\t\tx",
        "end  ",
        "x \n  y",
        '"}},\n  {"type"',
        "A\n- b\n```json\n{",
        "12345678 3.14159",
        "\u00e9t\u00e9 \u00e0 5",
    ]  # last: not ASCII
    counter = T._reference_counter()
    assert [counter(t) for t in tricky] == [len(tok.encode(t, add_special_tokens=False).ids) for t in tricky]


def test_encode_example_masks_the_prompt(data, tok):
    e = data["geometry"]["train"][0]
    prompt = tok.encode(e.prompt, add_special_tokens=False).ids
    answer = tok.encode(e.answer, add_special_tokens=False).ids
    ids, labels = T.encode_example(tok, e, 512)
    assert ids == prompt + answer + [0]  # the reference models' EOS (config.json eos_token_id) is 0
    assert labels == [-100] * len(prompt) + answer + [0]
    assert T.encode_example(tok, e, 512, eos=False) == (prompt + answer, [-100] * len(prompt) + answer)
    with pytest.raises(ValueError, match="longer than max_len"):
        T.encode_example(tok, e, len(ids) - 1)
    for ex in data["ui-reply"]["validation"]:  # every example fits the reference models' 512 positions
        ids, labels = T.encode_example(tok, ex, 512)
        assert len(ids) <= T.UI_MAX_TOKENS and ids[-1] == 0 and labels[0] == -100


def test_encode_example_with_a_transformers_style_tokenizer(tok):
    class HFLike:  # encode returns a list and takes add_special_tokens; eos_token_id attribute
        eos_token_id = 0

        def encode(self, text, add_special_tokens=True):
            return tok.encode(text, add_special_tokens=False).ids

    e = Example("Q: x?\nA:", " 1+1=2", "2")
    ids, labels = T.encode_example(HFLike(), e, 64)
    assert ids[-1] == 0 and labels.count(-100) == len(HFLike().encode(e.prompt))


# --------------------------------------------------------------------------- files


def test_write_load_round_trip(tmp_path, tok):
    out = T.write_task("geometry", tmp_path / "geo", seed=3, tokenizer=tok, tokenizer_name="ref")
    assert T.load_task(out) == T.generate_task("geometry", 3)
    info = T.read_task_info(out)
    assert info["name"] == "geometry" and info["seed"] == 3 and info["generator_version"] == T.GENERATOR_VERSION
    assert info["sizes"] == dict(T.SPLIT_SIZES)
    assert 25 <= info["tokens"]["all"]["mean"] <= 40 and info["tokens"]["tokenizer"] == "ref"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind
    with pytest.raises(FileExistsError, match="overwrite"):
        T.write_task("geometry", out, seed=4)
    T.write_task("geometry", out, seed=4, overwrite=True)
    assert T.read_task_info(out)["seed"] == 4
    (tmp_path / "empty").mkdir()
    ui = T.write_task("ui-reply", tmp_path / "empty", sizes=SMALL)  # an empty directory is fine
    assert T.load_task(ui) == T.generate_task("ui-reply", 0, sizes=SMALL)
    assert T.read_task_info(ui)["token_budget"]["max_tokens"] == 500


def test_load_task_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        T.load_task(tmp_path / "nope")
    d = tmp_path / "t"
    d.mkdir()
    (d / "train.jsonl").write_text(json.dumps({"prompt": "p", "answer": " a", "target": "1"}) + "\n")
    with pytest.raises(FileNotFoundError, match="validation.jsonl, test.jsonl"):
        T.load_task(d)
    (d / "validation.jsonl").write_text("\n")
    (d / "test.jsonl").write_text('{"prompt": "p"}\n')
    with pytest.raises(TaskError, match=r"test.jsonl:1: missing field\(s\) answer, target"):
        T.load_task(d)
    (d / "test.jsonl").write_text('{"prompt": "p", "answer": "a", "target": "1"}\nnot json\n')
    with pytest.raises(TaskError, match="test.jsonl:2: not JSON"):
        T.load_task(d)
    (d / "test.jsonl").write_text('{"prompt": "p", "answer": "a", "target": 1}\n')
    with pytest.raises(TaskError, match="target must be strings"):
        T.load_task(d)
    (d / "test.jsonl").write_text("")
    splits = T.load_task(d)
    assert splits["train"] == [Example("p", " a", "1")] and splits["validation"] == splits["test"] == []


def test_bad_arguments():
    with pytest.raises(TaskError, match="known: geometry, ui-reply, recall"):
        T.generate_task("geometry3k")
    with pytest.raises(TypeError, match="seed must be an int"):
        T.generate_task("geometry", "0")
    with pytest.raises(TypeError):
        T.generate_task("geometry", True)
    with pytest.raises(ValueError, match=">= 0"):
        T.generate_task("geometry", -1)
    with pytest.raises(ValueError, match="sizes"):
        T.generate_task("geometry", sizes={"train": 3})
    with pytest.raises(TaskError):
        T.is_correct("nope", Example("p", "a", "1"), "a")


# --------------------------------------------------------------------------- CLI


def test_cli_tasks(tmp_path, capsys):
    out = tmp_path / "geo"
    assert main(["tasks", "geometry", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1472 examples" in text and "224 examples" in text and "601 examples" in text
    assert "tokens per example" in text
    assert len(T.load_task(out)["test"]) == 601
    assert main(["tasks", "--list"]) == 0
    assert "ui-reply" in capsys.readouterr().out
    assert main(["tasks", "geometry", "--out", str(out)]) == 2  # exists: refused, one line
    assert "already exists" in capsys.readouterr().err
    assert main(["tasks", "nope", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "unknown task 'nope'" in err and "geometry, ui-reply" in err
    assert main(["tasks"]) == 2
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- recall: the answer beyond every window


@pytest.fixture(scope="module")
def recall():
    return T.generate_task("recall", 0, sizes={"train": 300, "validation": 50, "test": 50})


def test_recall_answer_lies_beyond_every_window(recall, tok):
    """Counted with the tokenizer itself (not the generator's counter): the queried line ends at least 96
    tokens before the answer's first token (the reference models' window is 64 tokens, every layer), the
    example fits 500 tokens with EOS, and the answer's digits appear in the prompt once, in that line."""
    from kvgraft.data.tasks.recall import RECALL_MIN_DISTANCE, RECALL_WINDOW

    assert RECALL_MIN_DISTANCE > RECALL_WINDOW
    distances = []
    for e in _all(recall):
        ids, _ = T.encode_example(tok, e, max_len=512)
        assert len(ids) <= 500
        line_end = e.prompt.index(f": {e.target}\n") + len(f": {e.target}\n")
        prompt_ids = tok.encode(e.prompt).ids
        assert tok.encode(e.prompt[:line_end]).ids == prompt_ids[: len(tok.encode(e.prompt[:line_end]).ids)]
        distances.append(len(prompt_ids) - len(tok.encode(e.prompt[:line_end]).ids))
        assert e.prompt.count(e.target) == 1 and e.answer == " " + e.target and e.kind == "recall"
        key = e.prompt.rsplit("code of ", 1)[1].split("?", 1)[0]
        assert e.prompt.count("\n" + key + ":") == 1 and f"\n{key}: {e.target}\n" in e.prompt
    assert min(distances) >= RECALL_MIN_DISTANCE
    assert max(distances) > 3 * RECALL_WINDOW  # the queried line is drawn over the whole eligible range


def test_recall_scoring_and_files(recall, tmp_path):
    e = recall["test"][0]
    assert T.is_correct("recall", e, e.answer) and T.is_correct("recall", e, e.prompt + e.answer + "\nmore")
    wrong = f"{(int(e.target) + 1) % 10000:04d}"
    assert not T.is_correct("recall", e, " " + wrong) and not T.is_correct("recall", e, " " + e.target + "5")
    assert T.extract_answer("recall", " no digits") is None
    out = T.write_task("recall", tmp_path / "recall", sizes={"train": 10, "validation": 2, "test": 2})
    info = T.read_task_info(out)
    assert info["distance"]["min_tokens"] == 96 and info["distance"]["window"] == 64
    assert info["token_budget"]["max_tokens"] == 500
