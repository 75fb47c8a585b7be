#!/usr/bin/env bash
# ARM64 install test: test-install.sh in an arm64 Debian 12 root under qemu-user-static
# (binfmt_misc, registered by lib.sh with the F flag), plus the agent's unit tests
# (tests/unit, run with the root's python3-pytest against the installed package).
#
#   packaging/test-arm64.sh [--deb FILE] [--no-unit-tests] [--full] [--prepare-only]
#
# By default the root comes from a cached layer holding the package's dependencies and the
# test tools (built on the first run and whenever the Depends field changes; see
# test-install.sh --deps-layer): `apt-get install ./millwright_*.deb` then installs the
# package itself, running its maintainer scripts under qemu. --full installs every
# dependency under qemu on this run as well (about two minutes more).
#
# The pristine arm64 root (debootstrap --foreign + second stage under qemu) is the slow
# part and is cached in packaging/.roots/ like the amd64 one; see docs/packaging.md for
# the durations from scratch and cached.
set -euo pipefail
unit=(--unit-tests)
layer=(--deps-layer)
pass=()
while [ $# -gt 0 ]; do
  case "$1" in
    --deb) pass+=(--deb "$2"); shift 2 ;;
    --no-unit-tests) unit=(); shift ;;
    --full) layer=(); shift ;;   # install the dependencies under qemu on this run too
    --prepare-only) pass+=(--prepare-only); shift ;;   # only build the cached roots
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "test-arm64: unknown argument $1" >&2; exit 2 ;;
  esac
done
# Unit tests that cannot pass under qemu-user emulation, each for a reason that is not the
# package's nor arm64's (reported to their owners). MW_UNIT_PYTEST_ARGS replaces the list.
qemu_deselect=(
  # /proc/<pid>/exe of an emulated process is the qemu interpreter, not the program, so
  # degraded mode's exec detection sees qemu-aarch64-static instead of "sleep".
  tests/unit/test_signals_degraded.py::test_degraded_mode_polls_proc_for_processes_and_node_counters
  # Timing: assumes the audit writer thread cannot dequeue while the test holds its io
  # lock; 10-20x slower under emulation, the drops split into several gap records.
  tests/unit/test_audit_writer.py::test_drops_at_shutdown_still_become_a_gap
)
if [ -z "${MW_UNIT_PYTEST_ARGS+x}" ]; then
  MW_UNIT_PYTEST_ARGS=$(printf -- '--deselect %s ' "${qemu_deselect[@]}")
  export MW_UNIT_PYTEST_ARGS
fi
MW_PROG=test-arm64 exec bash "$(dirname "$0")/test-install.sh" --arch arm64 "${unit[@]}" "${layer[@]}" "${pass[@]}"
