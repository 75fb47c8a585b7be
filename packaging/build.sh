#!/usr/bin/env bash
# Build the millwright .deb from the current tree into packaging/out/ (`make deb`).
#
#   packaging/build.sh [--version V] [--config FILE] [--out DIR] [--no-lint]
#
# The version is agent/__init__.py's __version__ unless --version is given (the upgrade
# test builds "N+1" that way); --config replaces configs/agent.yaml as the shipped
# conffile. The source tree for dpkg-buildpackage is laid out under OUT/.build/: agent/
# (whatever it holds now, without bytecode), bpf/, configs/agent.yaml, README.md,
# CHANGELOG.md, docs/*.md and packaging/debian/ with a changelog generated for the version.
# Then lintian runs on the result and must report no error and no warning.
set -euo pipefail
MW_PROG=build
source "$(dirname "$0")/lib.sh"

version="" config="$MW_REPO/configs/agent.yaml" lint=1
while [ $# -gt 0 ]; do
  case "$1" in
    --version) version=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --out) MW_OUT=$2; shift 2 ;;
    --no-lint) lint=0; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) mw_die "unknown argument $1" ;;
  esac
done
[ -n "$version" ] || version=$(mw_version)
# A native package: the version is the upstream version, so no Debian revision ("-").
[[ "$version" =~ ^[0-9][A-Za-z0-9.+~]*$ ]] || mw_die "version '$version' is not a valid native Debian version"
[ -f "$config" ] || mw_die "no config file $config"
mw_require_cmds dpkg-buildpackage dh dh_python3 help2man
[ "$lint" = 0 ] || mw_require_cmds lintian

t0=$(mw_now)
mkdir -p "$MW_OUT"
MW_OUT=$(cd "$MW_OUT" && pwd)
exec 8>"$MW_OUT/.lock"
flock 8

build="$MW_OUT/.build"
src="$build/millwright-$version"
rm -rf "$build"
mkdir -p "$src/configs" "$src/docs"

tar -C "$MW_REPO" --exclude=__pycache__ --exclude='*.pyc' --exclude='*.pyo' -cf - agent | tar -C "$src" -xf -
# The package's version is the program's: `millwright --version` shows what dpkg installed
# (an upgrade test can then tell N from N+1).
sed -i "s/^__version__ = .*/__version__ = \"$version\"/" "$src/agent/__init__.py"
grep -q "^__version__ = \"$version\"$" "$src/agent/__init__.py" || mw_die "could not stamp version $version"
if [ -d "$MW_REPO/bpf" ]; then
  tar -C "$MW_REPO" --exclude='.*' -cf - bpf | tar -C "$src" -xf -
fi
cp "$config" "$src/configs/agent.yaml"
[ ! -d "$MW_REPO/configs/demo" ] || cp -r "$MW_REPO/configs/demo" "$src/configs/demo"
for f in README.md CHANGELOG.md; do
  [ ! -f "$MW_REPO/$f" ] || cp "$MW_REPO/$f" "$src/"
done
find "$MW_REPO/docs" -maxdepth 1 -name '*.md' -exec cp {} "$src/docs/" \;
cp -r "$MW_PKG_DIR/debian" "$src/debian"

# Reproducible timestamps: the last commit's time when the tree is a git checkout.
epoch=$(git -C "$MW_REPO" log -1 --format=%ct 2>/dev/null || true)
[ -n "$epoch" ] || epoch=$(date +%s)
export SOURCE_DATE_EPOCH=$epoch
cat > "$src/debian/changelog" <<EOF
millwright ($version) unstable; urgency=medium

  * Millwright $version, built from the project tree.

 -- Millwright maintainers <millwright@example.com>  $(date -u -R -d "@$epoch")
EOF

mw_log "dpkg-buildpackage millwright $version"
root_cmd=()
[ "$(id -u)" = 0 ] || root_cmd=(-rfakeroot)
if ! (cd "$src" && dpkg-buildpackage -b -us -uc "${root_cmd[@]}") >"$build/build.log" 2>&1; then
  tail -n 40 "$build/build.log" >&2
  mw_die "dpkg-buildpackage failed (log: $build/build.log)"
fi

deb="$MW_OUT/millwright_${version}_all.deb"
rm -f "$MW_OUT/millwright_${version}_"*
mv "$build/millwright_${version}_all.deb" "$build/millwright_${version}_"*.buildinfo \
   "$build/millwright_${version}_"*.changes "$MW_OUT/"

# The unit tests as they were at build time, for the arm64 test to run against this very
# package (the tree may have moved on by then).
mw_tests_tar > "$MW_OUT/millwright_${version}_tests.tar" || rm -f "$MW_OUT/millwright_${version}_tests.tar"

if [ "$lint" = 1 ]; then
  mw_log "lintian"
  # Errors and warnings fail the build; info tags are shown. Overrides, each justified,
  # are in packaging/debian/millwright.lintian-overrides.
  lopts=(--fail-on error,warning --display-level '>=info')
  [ "$(id -u)" != 0 ] || lopts+=(--allow-root)
  if ! lintian "${lopts[@]}" "$deb" >"$build/lintian.log" 2>&1; then
    cat "$build/lintian.log" >&2
    mw_die "lintian reported errors or warnings"
  fi
  if [ -s "$build/lintian.log" ]; then sed 's/^/  /' "$build/lintian.log" >&2; else mw_log "lintian: clean"; fi
fi
exec 8>&-

size=$(stat -c %s "$deb")
isize=$(dpkg-deb -f "$deb" Installed-Size)
mw_log "built $deb: $size bytes (.deb), installed size $isize KiB, in $(mw_since "$t0")s"
printf '%s\n' "$deb"
