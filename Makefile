# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The torch release to install; override with `make test TORCH=torch` for the newest.
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test test-random install clean gpu-check

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip >/dev/null
	$(PIP) install "$(TORCH)"
	$(PIP) install -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/harmonia demo

# Single-process tests on every core (each file on one worker), then the multi-process ones one at
# a time (they time ranks and hangs); PYTEST_ARGS go to both (e.g. -k NAME, -x).
TEST_WORKERS ?= 2
TEST_PHASES = "-n $(TEST_WORKERS) --dist loadfile tests/unit" "tests/distributed tests/e2e"

test: install
	@rc=0; for phase in $(TEST_PHASES); do \
		$(PY) -m pytest $$phase $(PYTEST_ARGS); r=$$?; \
		if [ $$r -eq 5 ]; then echo "no tests selected in $$phase"; elif [ $$r -ne 0 ]; then rc=$$r; fi; \
	done; exit $$rc

# The property tests with fresh random seeds (CI runs them derandomized).
test-random: install
	HYPOTHESIS_PROFILE=random $(PY) -m pytest tests/unit $(PYTEST_ARGS)

# On a machine with a GPU (and its own torch: it may have no network): attention kernels' parity, one
# training step of a 2B LLaVA beside transformers', no host sync in a step's actions (gpu_sync_audit.py), and
# harmonia train on the device (a tiny job, and an 8B LLaVA with LoRA), saved under benchmarks/results/ (9 minutes at most). `benchmarks/gpu_check.py --tiny` is the CPU smoke run the test suite makes.
GPU_PY = $(if $(wildcard $(PY)),$(abspath $(PY)),python3)
gpu-check:
	cd benchmarks && timeout 540 $(GPU_PY) gpu_check.py

clean:
	rm -rf $(VENV) build *.egg-info
