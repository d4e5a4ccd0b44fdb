"""`import kvgraft` and `kvgraft --help` stay light: no transformers (nor torch for --help).

Each check runs in a fresh interpreter, since this test process has imported everything already.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HEAVY = ("transformers", "peft", "accelerate", "matplotlib", "safetensors")


def _modules_after(code: str) -> set[str]:
    """Top-level names of the modules a fresh interpreter has imported after running ``code``."""
    script = code + "\nimport sys\nprint(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split("\n")[-2].split())


def test_import_kvgraft_imports_neither_torch_nor_transformers():
    loaded = _modules_after("import kvgraft")
    assert "kvgraft" in loaded
    assert loaded.isdisjoint(HEAVY + ("torch",)), sorted(loaded & set(HEAVY + ("torch",)))


def test_help_imports_neither_torch_nor_transformers():
    code = (
        "import contextlib, io\n"
        "from kvgraft.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, exc.code\n"
        "assert 'convert' in out.getvalue()\n"
    )
    loaded = _modules_after(code)
    assert loaded.isdisjoint(HEAVY + ("torch", "numpy", "tokenizers")), sorted(
        loaded & set(HEAVY + ("torch", "numpy", "tokenizers"))
    )


def test_python_m_kvgraft_help_exits_0():
    result = subprocess.run([sys.executable, "-m", "kvgraft", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: kvgraft" in result.stdout


def test_unknown_pretrain_preset_is_an_argparse_error(capsys):
    from kvgraft.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["pretrain", "--data", "d", "--out", "o", "--model", "no-such-preset"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "no-such-preset" in err and "llama-8m" in err
