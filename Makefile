# `make run` and `make test` each set up .venv on a fresh machine by themselves.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# constraints.txt pins torch to the CPU build where the machine has it (see the file).
PIP_INSTALL := $(BIN)/pip install -q -c constraints.txt

.PHONY: run test bench-bus gpu-check docs docs-serve clean

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(PIP_INSTALL) -e '.[dev,gpu]'
	# verl's own math scorers, scored side by side in tests/scorers/test_math_parity.py; without its
	# dependencies (Ray, Megatron, ...): the test loads those modules from their files
	$(PIP_INSTALL) --no-deps 'verl==0.9.1'
	touch $@

run: $(BIN)/.installed
	$(BIN)/streamrl run

# .ci/test-tools installs prometheus, promtool and amtool (root with apt-get), or says in one
# line what to install. Two passes: the tests that start a local Ray cluster (marked `ray` by
# tests/conftest.py) alone, then the rest on four workers. Beside three end-to-end runs on 2 cores
# a Ray run's stages did not start in 240 s (a CI run on a slower machine); alone they pass in ~9
# minutes. Both passes run; the target fails if either does (pytest's 5, no tests, included).
PYTEST := $(BIN)/python -m pytest -q --durations=15
test: $(BIN)/.installed
	$(BIN)/ruff check
	.ci/test-tools
	ray=0; $(PYTEST) -m ray || ray=$$?; \
	rest=0; $(PYTEST) -n 4 --dist loadgroup -m "not ray" || rest=$$?; \
	echo "make test: the Ray tests exited $$ray, the rest $$rest"; \
	[ $$ray = 0 ] && [ $$rest = 0 ]

# The docs site (mkdocs.yml): built strictly into site/ (a broken link fails), or served with live
# reload on http://127.0.0.1:8000. The configuration, CLI and metrics reference pages are
# generated from the code as it builds (docs/hooks.py).
docs: $(BIN)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

docs-serve: $(BIN)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs serve

bench-bus: $(BIN)/.installed
	$(BIN)/streamrl bench bus

# The learner (FSDP2, bf16, ~0.5B Qwen2 shape, padded and packed, against a bare loop), the
# reward model's batching and, where vLLM is installed, an fp8-quantised vLLM rollout reloading
# bf16 versions, on one GPU, offline, in under 8 minutes: tools/gpu_check.py (its header says
# how to download WHEELS). `make gpu-check DEVICE=cpu` tests the script without a GPU.
DEVICE ?= cuda
WHEELS ?=
gpu-check:
	$(PYTHON) tools/gpu_check.py --device $(DEVICE) $(if $(WHEELS),--wheels $(WHEELS))

clean:
	rm -rf $(VENV) site
