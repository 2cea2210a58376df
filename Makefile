# Two commands: `make demo` (the main job on real data) and `make test` (the test suite).
# Both create .venv if it is missing and install the pinned set from constraints.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The real data files: ../shared/data beside this checkout when it exists (this workplace, CI);
# elsewhere jaxray searches ~/.cache/jaxray and the system data folder, then downloads.
ifeq ($(origin JAXRAY_DATA_DIR), undefined)
ifneq ($(wildcard ../shared/data/tinyshakespeare.txt),)
export JAXRAY_DATA_DIR := $(abspath ../shared/data)
endif
endif

.PHONY: install demo lint test test-all clean

install: $(STAMP)

# uv installs in seconds where pip took a minute; --compile-bytecode as pip does: with
# PYTHONDONTWRITEBYTECODE set, each of Ray's worker processes would compile its imports again.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt uv
	$(VENV)/bin/uv pip install --python $(PY) --quiet --compile-bytecode -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: install
	$(PY) -m jaxray.tune --config tune_configs/demo.yaml --out runs/demo
	$(PY) -m jaxray.generate --checkpoint runs/demo --prompt "ROMEO:" --max-new-tokens 200 --temperature 0.8 --seed 0

# make lint: ruff's lint rules and formatting (pyproject.toml [tool.ruff]); make test runs it first.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# make test: everything but the slowest tests (marked slow), two pytest workers (pytest-xdist; one
# that runs out of tests steals from the other), about 4 minutes on 2 cores; make test-all (CI):
# then the slow ones on two workers, a module at a time each (a module's fixtures are built once),
# each part printing its 25 slowest. Beside them, in a process of its own whose first Ray is their
# cluster, the multi-node cluster tests: they mostly wait (pauses, node deaths, Ray's resize checks),
# so they take little of the two cores; their output is printed when both are done (Ctrl-C ends
# both).
test: install lint
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow"

CLUSTER_TESTS = tests/integration/test_cluster_failures.py
test-all: install lint
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow" --durations=25
	log=$$(mktemp); base=$$(mktemp -d); \
	$(PY) -m pytest -q -p no:cacheprovider -m slow --durations=5 --basetemp=$$base/t $(CLUSTER_TESTS) \
	  > $$log 2>&1 & cluster=$$!; \
	trap 'kill $$cluster 2>/dev/null; rm -rf $$log $$base; exit 130' INT TERM; \
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m slow --durations=25 \
	  --ignore=$(CLUSTER_TESTS); slow=$$?; \
	wait $$cluster; rc=$$?; echo "== $(CLUSTER_TESTS), run beside the slow part =="; cat $$log; \
	rm -rf $$log $$base; [ $$slow -eq 0 ] && [ $$rc -eq 0 ]

clean:
	rm -rf runs .pytest_cache
