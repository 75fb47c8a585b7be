#!/usr/bin/env bash
# Install the pinned lint tools (requirements-lint.txt: ruff, mypy, type stubs) from PyPI
# into the project-local .cache/lint, like `make paho2`: nothing goes into the system
# python. Re-installs only when requirements-lint.txt changed. Run by scripts/setup-host.sh
# and by `make lint`.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PY:-/usr/bin/python3}
dir="$repo/.cache/lint"
req="$repo/requirements-lint.txt"
if [ -x "$dir/bin/ruff" ] && cmp -s "$req" "$dir/.installed" 2>/dev/null; then
  exit 0
fi
if ! "$py" -m pip --version >/dev/null 2>&1; then
  echo "lint-tools: $py has no pip: run \`make setup\` (installs python3-pip)" >&2
  exit 1
fi
echo "lint-tools: installing $(grep -v '^#' "$req" | tr '\n' ' ')into .cache/lint" >&2
rm -rf "$dir"
"$py" -m pip install -q --disable-pip-version-check --no-warn-script-location --target "$dir" -r "$req"
cp "$req" "$dir/.installed"
