# Millwright. `make demo` shows the product, `make test` runs the whole suite.
# Both prepare the host themselves (packages, kernel headers link, tracefs) as root.
PY ?= /usr/bin/python3
PYTEST_ARGS ?=
export PYTHONDONTWRITEBYTECODE = 1

.PHONY: setup demo test test-unit test-integration test-kernel bench deb clean reference

setup:
	@bash scripts/setup-host.sh

demo: setup
	$(PY) -m agent demo

test: setup
	$(PY) -m pytest -p no:cacheprovider $(PYTEST_ARGS)

test-unit:
	$(PY) -m pytest -p no:cacheprovider tests/unit $(PYTEST_ARGS)

test-integration: setup
	$(PY) -m pytest -p no:cacheprovider tests/integration $(PYTEST_ARGS)

test-kernel: setup
	$(PY) -m pytest -p no:cacheprovider tests/kernel $(PYTEST_ARGS)

bench: setup
	@for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

reference:
	@$(PY) scripts/update-reference.py

clean:
	rm -rf build dist .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +

# --- packaging (packaging/, docs/packaging.md) ---
.PHONY: test-packaging
deb: setup
	@bash packaging/build.sh

test-packaging: setup
	$(PY) -m pytest -p no:cacheprovider tests/packaging $(PYTEST_ARGS)
