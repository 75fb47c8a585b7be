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
	@$(MAKE) --no-print-directory test-cloud-paho2

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

# the installed .deb under a real systemd (systemd-nspawn --boot; needs systemd-container)
.PHONY: test-systemd
test-systemd: setup
	$(PY) packaging/test-systemd.py

# --- cloud channel (agent/cloud, docs/cloud.md) ---
# The .deb uses Debian's paho-mqtt 1.6; the cloud tests run a second time against paho-mqtt
# 2.x from PyPI, installed into a project-local directory (never into the system).
PAHO2_DIR ?= .cache/paho2
.PHONY: paho2 test-cloud-paho2
paho2:
	@[ -f $(PAHO2_DIR)/paho/mqtt/client.py ] || $(PY) -m pip install -q --disable-pip-version-check \
		--no-warn-script-location --target $(PAHO2_DIR) 'paho-mqtt>=2,<3'

test-cloud-paho2: paho2
	PYTHONPATH=$(PAHO2_DIR) MILLWRIGHT_EXPECT_PAHO=2 MILLWRIGHT_CLOUD_QUICK=1 MILLWRIGHT_CLOUD_OUTAGE_S=10 \
		$(PY) -m pytest -p no:cacheprovider tests/unit/test_cloud.py tests/integration/test_cloud_agents.py \
		tests/integration/test_cloud_outbox.py tests/integration/test_cloud_ingest.py -k "not fuzz_ingest" $(PYTEST_ARGS)
