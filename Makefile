PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup test test-fast test-lowest lint models clean

STAMP := $(VENV)/.installed

# Re-runs whenever pyproject.toml changes, so an existing venv picks up new dependencies.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The local CPU build; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# nixl: the --transport nixl tests run on the CPU too (UCX's shared memory and TCP)
	$(BIN)/pip install -q -e '.[test,dev,nixl]'
	touch $(STAMP)

setup: $(STAMP)

models: setup
	$(BIN)/python -m engine.checkpoints fetch smollm2-135m-instruct
	$(BIN)/python -m engine.checkpoints fetch gemma3-270m

# Two pytest processes side by side: the tests that start servers, one module after another as in one process
# (their engines' memory never overlaps: one engine process is ~1.4 GB, a module runs up to eleven), and the
# rest (unit, engine, transfer tests: ~150 s on 2 cores, ~3 GB), whose output follows. TEST_SPLIT=0: one process.
SERVER_TESTS := tests/pd tests/deploy tests/bench/load tests/engine/models/test_golden_real.py
TEST_SPLIT ?= 1
test: setup models
ifeq ($(TEST_SPLIT),0)
	$(BIN)/python -m pytest -q -ra
else
	@rest_log=$$(mktemp); \
	$(BIN)/python -m pytest -q -ra -p no:cacheprovider $(addprefix --ignore=,$(SERVER_TESTS)) >$$rest_log 2>&1 & rest=$$!; \
	$(BIN)/python -m pytest -q -ra $(SERVER_TESTS); servers=$$?; \
	wait $$rest; others=$$?; \
	echo "---- the other tests (beside the server tests): $(BIN)/python -m pytest $(addprefix --ignore=,$(SERVER_TESTS))"; \
	cat $$rest_log; rm -f $$rest_log; \
	test $$servers = 0 && test $$others = 0
endif

test-fast: setup
	$(BIN)/python -m pytest -q -ra -m "not slow"

lint: setup
	$(BIN)/ruff check engine pdkernels pd transfer bench tests
	$(BIN)/mypy

# docs/reference/flags.md and metrics.md, generated from the code (tests/pd/tools/test_docs_ref.py fails when
# the committed files differ from what this writes)
.PHONY: docs
docs: setup
	$(BIN)/python -m pd.tools.docs_ref

clean:
	rm -rf $(VENV) $(LOWEST_VENV)

# ---- the lower bounds in pyproject.toml, installed and smoke-tested (CI runs it after `make test`) ----
LOWEST_VENV ?= .venv-lowest
# requires-python's floor; pyenv's build where there is one (uv does not look inside pyenv)
LOWEST_PYTHON ?= $(or $(shell pyenv prefix 3.10 2>/dev/null),3.10)
LOWEST_STAMP := $(LOWEST_VENV)/.installed
# Its own models, converted by these versions (a newer transformers' conversion may not load in an older one),
# kept outside the venv so that rebuilding it reuses them: LOWEST_HOME/versions.txt says which versions (and
# which engine/checkpoints code) converted them, and a rebuild that installs anything else converts them anew.
LOWEST_HOME ?= $(or $(PDSERVE_HOME),$(HOME)/.cache/pdserve)/lowest
LOWEST_RUN := PDSERVE_HOME=$(LOWEST_HOME) $(LOWEST_VENV)/bin/python

# Every direct dependency (the test extra's too) at its lower bound, what they pull in at its newest.
# torch comes from PyPI, its CUDA build (it runs on the CPU): CPU builds are only on download.pytorch.org,
# which CI does not reach.
# uv's cache (~/.cache/uv, about 7 GB) makes a rebuild seconds; --seed: engine.checkpoints installs with pip.
$(LOWEST_STAMP): pyproject.toml $(STAMP)
	rm -rf $(LOWEST_VENV)
	$(BIN)/uv venv -q --seed --python $(LOWEST_PYTHON) $(LOWEST_VENV)
	$(BIN)/uv pip install -q --python $(LOWEST_VENV)/bin/python --resolution lowest-direct -e '.[test]'
	{ $(BIN)/uv pip freeze --python $(LOWEST_VENV)/bin/python | grep -v '^-e '; \
	  cat engine/checkpoints/*.py | sha256sum; } >$(LOWEST_VENV)/versions.txt
	cmp -s $(LOWEST_VENV)/versions.txt $(LOWEST_HOME)/versions.txt || rm -rf $(LOWEST_HOME)/models
	$(LOWEST_RUN) -m engine.checkpoints fetch smollm2-135m-instruct
	cp $(LOWEST_VENV)/versions.txt $(LOWEST_HOME)/versions.txt
	touch $(LOWEST_STAMP)

test-lowest: $(LOWEST_STAMP)
	$(LOWEST_RUN) -m pytest -q -ra -m smoke

# ---- demo (owned by the server work) ----
.PHONY: demo
demo: setup
	$(BIN)/python -m engine.checkpoints fetch smollm2-135m-instruct
	deploy/pd_run.sh start localhost localhost
	$(BIN)/python -m pd.tools.demo --url http://127.0.0.1:8888/v1 --stop-command "deploy/pd_run.sh stop localhost localhost"
