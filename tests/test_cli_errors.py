"""The CLI tells a user error from a bug: ``KvgraftError`` (and its subclasses), ``OSError`` and argparse's
errors print one line and exit 2; any other exception propagates from ``main``, and the program (``run``)
prints its traceback with a note to report it and exits 1. Values the runtime refuses with a plain ``ValueError`` (sampling, the KV budget) are user errors
where the CLI passes a user's value on."""

from __future__ import annotations

import pytest

import kvgraft.cli.cmd.models as models_command
from kvgraft.cli import BUG_NOTE, EXIT_BUG, EXIT_ERROR, main, run
from kvgraft.errors import CheckpointError, ConfigError

NAME = "smollm2-135m-instruct"  # a fetchable name (argparse's choices); the command itself is replaced


def run_raising(monkeypatch, capsys, exc: BaseException) -> tuple[int, str]:
    def boom(args):
        raise exc

    monkeypatch.setattr(models_command, "fetch", boom)
    rc = run(["fetch", NAME])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    "exc",
    [
        ConfigError("rank (0) must be a positive integer"),
        CheckpointError("rank (0) must be a positive integer"),
        FileNotFoundError("rank (0) must be a positive integer"),
    ],
)
def test_user_errors_are_one_line_with_status_2(monkeypatch, capsys, exc):
    rc, err = run_raising(monkeypatch, capsys, exc)
    assert rc == EXIT_ERROR == 2
    assert err == "kvgraft: error: rank (0) must be a positive integer\n"


@pytest.mark.parametrize("exc", [ValueError("a shape mismatch"), RuntimeError("a shape mismatch"), KeyError("q_proj")])
def test_a_bug_prints_its_traceback_and_asks_for_a_report(monkeypatch, capsys, exc):
    rc, err = run_raising(monkeypatch, capsys, exc)
    assert rc == EXIT_BUG == 1
    assert err.startswith("Traceback (most recent call last):")
    assert type(exc).__name__ in err and "boom" in err  # the traceback names the exception and where it rose
    assert err.rstrip("\n").endswith(BUG_NOTE)
    assert "kvgraft: error:" not in err
    with pytest.raises(type(exc)):
        main(["fetch", NAME])  # main lets a bug propagate


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["fetch", "no-such-model"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_a_runtime_refusal_of_a_user_value_is_a_user_error(capsys):
    rc = main(["generate", "--prompt", "hello", "--temperature", "-1"])
    err = capsys.readouterr().err
    assert rc == EXIT_ERROR
    assert err.startswith("kvgraft: error: temperature (-1.0) must be >= 0") and "Traceback" not in err
