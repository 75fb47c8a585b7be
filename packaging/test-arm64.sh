#!/usr/bin/env bash
# ARM64 install test: test-install.sh in an arm64 Debian 12 root under qemu-user-static
# (binfmt_misc, registered by lib.sh with the F flag), plus the agent's unit tests
# (tests/unit, run with the root's python3-pytest against the installed package).
#
#   packaging/test-arm64.sh [--deb FILE] [--no-unit-tests]
#
# The pristine arm64 root (debootstrap --foreign + second stage under qemu) is the slow
# part and is cached in packaging/.roots/ like the amd64 one; see docs/packaging.md for
# the durations from scratch and cached.
set -euo pipefail
unit=(--unit-tests)
pass=()
while [ $# -gt 0 ]; do
  case "$1" in
    --deb) pass+=(--deb "$2"); shift 2 ;;
    --no-unit-tests) unit=(); shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "test-arm64: unknown argument $1" >&2; exit 2 ;;
  esac
done
MW_PROG=test-arm64 exec bash "$(dirname "$0")/test-install.sh" --arch arm64 "${unit[@]}" "${pass[@]}"
