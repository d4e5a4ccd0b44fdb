"""The plugin's packaging (``kvgraft.vllm``, docs/vllm.md): vLLM finds it by its entry point and resolves the
architecture, from the repository root (an editable install; the source folder is ``src/``, so nothing named
``kvgraft`` or ``vllm`` shadows the installed packages there) and from an unrelated folder; and nothing
kvgraft imports by default pulls vLLM in, even where vLLM is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]

RESOLVE = """
import os
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
from vllm.plugins import load_general_plugins
from vllm import ModelRegistry
load_general_plugins()
import kvgraft, vllm
assert "KvgraftForCausalLM" in ModelRegistry.get_supported_archs(), "plugin did not register"
cls = ModelRegistry._try_load_model_cls("KvgraftForCausalLM")
assert cls is not None and cls.__name__ == "KvgraftCEDForCausalLM", cls
from transformers import AutoConfig
assert type(AutoConfig.from_pretrained({model!r})).__name__ == "KvgraftConfig"
print("OK", kvgraft.__file__, vllm.__file__)
"""


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH="")  # only what the environment installed
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("where", ["repo root", "elsewhere"])
def test_entry_point_registers_the_ced_model(where, tmp_path):
    cwd = ROOT if where == "repo root" else tmp_path
    done = _run(RESOLVE.format(model=str(ROOT / "models" / "kvgraft-ced-8m")), cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("OK"), done.stdout
    kvgraft_file, vllm_file = line.split()[1:]
    assert Path(kvgraft_file).is_relative_to(ROOT / "src"), kvgraft_file  # the editable install
    assert "site-packages" in vllm_file, vllm_file  # the installed vLLM, not a folder named vllm


def test_kvgraft_imports_never_pull_in_vllm():
    code = (
        "import sys\n"
        "import kvgraft, kvgraft.vllm, kvgraft.vllm.geometry, kvgraft.hf, kvgraft.runtime.engine, kvgraft.cli\n"
        "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
        "assert not bad, bad[:5]\n"
        "print('OK')\n"
    )
    done = _run(code, ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr[-3000:]
