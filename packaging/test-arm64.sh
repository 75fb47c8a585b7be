#!/usr/bin/env bash
# ARM64 install test: test-install.sh in an arm64 Debian 12 root under qemu-user-static
# (binfmt_misc, registered by lib.sh with the F flag), plus the agent's unit tests
# (tests/unit, run with the root's python3-pytest against the installed package).
#
#   packaging/test-arm64.sh [--deb FILE] [--no-unit-tests] [--full]
#
# By default the root comes from a cached layer holding the package's dependencies and the
# test tools (built on the first run and whenever the Depends field changes; see
# test-install.sh --deps-layer): `apt-get install ./millwright_*.deb` then installs the
# package itself, running its maintainer scripts under qemu. --full installs every
# dependency under qemu on this run as well (about 8 minutes more).
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
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "test-arm64: unknown argument $1" >&2; exit 2 ;;
  esac
done
MW_PROG=test-arm64 exec bash "$(dirname "$0")/test-install.sh" --arch arm64 "${unit[@]}" "${layer[@]}" "${pass[@]}"
