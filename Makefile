# The two commands a new user needs: `make run` and `make test`. Both create the environment first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test check lint bench clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "Dispach needs Python 3.11 (found " + sys.version.split()[0] + "); set PYTHON=/path/to/python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip==25.3
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/dispach serve

# The suite runs on PYTEST_WORKERS xdist workers, each with its own Postgres and NATS
# (tests/conftest.py); a module whose tests share a module-scoped fixture stays on one worker
# (--dist loadgroup). The tests marked `alone` (they time what a user sees, or fuzz the API and
# need the machine) run afterwards, one at a time. One test alone:
# make test PYTEST_ARGS="-n0 tests/test_x.py::test_y".
# pytest exits 5 when it collects no tests; an empty selection is not a failure of the suite.
PYTEST_WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest --durations=20
test: $(STAMP)
	$(PYTEST) -n $(PYTEST_WORKERS) --dist loadgroup -m "not alone" $(PYTEST_ARGS); rc=$$?; if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi
	$(PYTEST) -n0 -m alone $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests marked alone selected"; exit 0; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

check: lint test

bench: $(STAMP)
	$(BIN)/python bench/eventstore.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
