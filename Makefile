# Millwright. `make demo` shows the product, `make test` runs the whole suite.
# Both prepare the host themselves (packages, kernel headers link, tracefs) as root.
PY ?= /usr/bin/python3
PYTEST_ARGS ?=
export PYTHONDONTWRITEBYTECODE = 1

.PHONY: setup demo test test-unit test-integration test-kernel bench deb clean reference lint lint-tools chaos chaos-mutants test-release

setup:
	@bash scripts/setup-host.sh

demo: setup
	$(PY) -m agent demo

# make test: the whole suite but the tests marked `release` (the slow forms of retention and
# windows), the arm64 install and unit tests under qemu included (started with the session,
# beside the rest: tests/support/arm64.py); the broker outage test with a 10 s outage (60 s
# in test-release)
test: setup lint
	MILLWRIGHT_CLOUD_OUTAGE_S=$${MILLWRIGHT_CLOUD_OUTAGE_S:-10} $(PY) -m pytest -p no:cacheprovider --durations=25 -m "not release" $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory test-cloud-paho2
	@$(MAKE) --no-print-directory test-cloud-sync-ack

test-unit:
	$(PY) -m pytest -p no:cacheprovider tests/unit $(PYTEST_ARGS)

test-integration: setup
	$(PY) -m pytest -p no:cacheprovider tests/integration $(PYTEST_ARGS)

test-kernel: setup
	$(PY) -m pytest -p no:cacheprovider tests/kernel $(PYTEST_ARGS)

# The seeded fault test (tests/support/chaos.py): `make chaos SEED=1234 MINUTES=2` reproduces a
# run; without SEED a new seed is drawn and printed; SEEDS=10 runs consecutive seeds; KINDS=a,b
# only those fault kinds.
SEED ?=
SEEDS ?= 1
MINUTES ?= 2
KINDS ?=
chaos: setup
	$(PY) -m tests.support.chaos $(if $(SEED),--seed $(SEED)) --seeds $(SEEDS) --minutes $(MINUTES) $(if $(KINDS),--kinds $(KINDS))

# The mutation harness (tests/support/mutants.py): each deliberate product bug of its table,
# one at a time, in a copy of the tree under /tmp, must make the fault test fail; prints the
# table and exits non-zero if one survives (about 20 minutes). MUTANTS=a,b runs only those.
MUTANTS ?=
chaos-mutants: setup
	$(PY) -m tests.support.mutants $(if $(MUTANTS),--only $(MUTANTS))

# Before a release, on top of `make test` (which runs the arm64 tier): the 60 s broker
# outage, ingest, flood and the 5,000 pushes under paho 2, the flap test's full 5 minutes, a job
# violating its exec policy on every agent for 2 minutes, the tests marked `release` in their
# slow form (windows of 20 s a minute for 3 minutes, retention driven
# to its larger bounds, a per-second job with 64 unmet dependencies watched for 10 minutes,
# ten consecutive 5-minute fault seeds from the commit's seed (CI runs that first seed for 2
# minutes), and the mutation harness: about 85 minutes.
test-release: setup
	MILLWRIGHT_CLOUD_OUTAGE_S=60 $(PY) -m pytest -p no:cacheprovider tests/integration/test_cloud_outbox.py $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory test-cloud-paho2 PAHO2_MORE="tests/integration/test_cloud_ingest.py tests/integration/test_cloud_flood.py -k 'not fuzz_ingest'"
	MILLWRIGHT_FLAP_TEST_S=300 $(PY) -m pytest -p no:cacheprovider tests/kernel/test_health_e2e.py -k flapping $(PYTEST_ARGS)
	MILLWRIGHT_SLOW=1 $(PY) -m pytest -p no:cacheprovider tests/kernel/test_health_e2e.py -k violating $(PYTEST_ARGS)
	MILLWRIGHT_SLOW=1 $(PY) -m pytest -p no:cacheprovider tests/integration/test_retention.py tests/integration/test_windows.py tests/integration/test_status_fanout.py $(PYTEST_ARGS)
	MILLWRIGHT_BOUNDED_WORK_S=600 $(PY) -m pytest -p no:cacheprovider tests/integration/test_bounded_work.py $(PYTEST_ARGS)
	$(PY) -m tests.support.chaos $(if $(SEED),--seed $(SEED),--from-commit) --seeds 10 --minutes 5
	$(PY) -m tests.support.mutants

bench: setup
	@for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# ruff (pyflakes, import order, bugbear) over the tree, mypy over agent/, and agent/'s import
# rules (scripts/check-imports.py: what each package may import, no private names across
# modules); config in pyproject.toml, pinned tools in requirements-lint.txt (in .cache/lint)
LINT_DIR ?= .cache/lint
lint: lint-tools
	$(LINT_DIR)/bin/ruff check .
	PYTHONPATH=$(LINT_DIR) $(PY) -m mypy
	$(PY) scripts/check-imports.py

lint-tools:
	@PY=$(PY) bash scripts/lint-tools.sh

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
.PHONY: paho2 test-cloud-paho2 test-cloud-sync-ack
paho2:
	@[ -f $(PAHO2_DIR)/paho/mqtt/client.py ] || $(PY) -m pip install -q --disable-pip-version-check \
		--no-warn-script-location --target $(PAHO2_DIR) 'paho-mqtt>=2,<3'

test-cloud-paho2: paho2
	PYTHONPATH=$(PAHO2_DIR) MILLWRIGHT_EXPECT_PAHO=2 MILLWRIGHT_CLOUD_QUICK=1 MILLWRIGHT_CLOUD_OUTAGE_S=10 \
		$(PY) -m pytest -p no:cacheprovider tests/unit/test_cloud.py tests/unit/test_cloud_answers.py \
		tests/unit/test_cloud_queries.py \
		tests/integration/test_cloud_agents.py tests/integration/test_cloud_outbox.py \
		tests/integration/test_cloud_subscriptions.py \
		tests/integration/test_cloud_answers.py tests/integration/test_cloud_broker.py tests/integration/test_status_fanout.py \
		tests/unit/test_cloud_mqtt5.py tests/integration/test_mqtt5_link.py \
		$(or $(PAHO2_MORE),-k "not 5000_pushes") $(PYTEST_ARGS)

# paho 1.x as if it had no _send_puback (an unknown paho): the PUBACK goes out when
# on_message returns, so the dispatcher must finish the durable write inside it. The
# tests that would see an acknowledged-but-lost push run in that mode.
test-cloud-sync-ack:
	MILLWRIGHT_TEST_PAHO_SYNC_ACK=1 MILLWRIGHT_CLOUD_QUICK=1 MILLWRIGHT_CLOUD_OUTAGE_S=10 \
		$(PY) -m pytest -p no:cacheprovider tests/unit/test_cloud.py \
		"tests/integration/test_cloud_agents.py::test_etcd_outage_never_acknowledges_a_push" \
		"tests/integration/test_cloud_agents.py::test_5000_pushes_survive_two_kill9_and_a_broker_restart" $(PYTEST_ARGS)
