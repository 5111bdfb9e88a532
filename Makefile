# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The torch release to install; override with `make test TORCH=torch` for the newest.
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test test-random install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip >/dev/null
	$(PIP) install "$(TORCH)"
	$(PIP) install -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/harmonia demo

test: install
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests selected"; exit 0; fi; exit $$rc

# The property tests with fresh random seeds (CI runs them derandomized).
test-random: install
	HYPOTHESIS_PROFILE=random $(PY) -m pytest tests/unit $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
