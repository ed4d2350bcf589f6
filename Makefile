PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup test test-fast lint models clean

STAMP := $(VENV)/.installed

# Re-runs whenever pyproject.toml changes, so an existing venv picks up new dependencies.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The local CPU build; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,dev]'
	touch $(STAMP)

setup: $(STAMP)

models: setup
	$(BIN)/python -m engine.models fetch smollm2-135m-instruct
	$(BIN)/python -m engine.models fetch gemma3-270m

test: setup models
	$(BIN)/python -m pytest -q -ra

test-fast: setup
	$(BIN)/python -m pytest -q -ra -m "not slow"

lint: setup
	$(BIN)/ruff check engine pdkernels pd transfer bench tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV)

# ---- demo (owned by the server work) ----
.PHONY: demo
demo: setup
	$(BIN)/python -m engine.models fetch smollm2-135m-instruct
	deploy/pd_run.sh start localhost localhost
	$(BIN)/python -m pd.tools.demo --url http://127.0.0.1:8888/v1 --stop-command "deploy/pd_run.sh stop localhost localhost"
