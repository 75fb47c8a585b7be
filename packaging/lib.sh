# Shared helpers for the packaging scripts (sourced, not executed).
#
# Roots: a pristine Debian 12 (bookworm) root per architecture is debootstrapped once and
# cached as a tarball in $MW_ROOTS. The default is a machine state dir,
# /var/cache/millwright-dev/roots, not a folder of the checkout: CI runs in a fresh clone
# on the same machine, and a cache inside the clone would be empty on every CI run
# (MW_ROOTS=packaging/.roots, gitignored, keeps it project-local). Every test
# extracts a fresh copy into its own work directory, so runs never see each other's state
# and two runs may go in parallel. Downloaded .debs are kept in a per-arch apt cache that
# is bind-mounted into the roots, so a cached run downloads nothing but the apt lists.
#
# Mounts: every command that enters a root runs in its own private mount namespace
# (unshare --mount), where /proc, /sys, /dev, /dev/pts, /dev/shm and the apt cache are
# mounted. Those mounts die with the namespace, whatever way the command exits (even
# SIGKILL), so nothing is ever left mounted on the host. mw_cleanup checks that anyway.

set -euo pipefail

MW_PKG_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MW_REPO=$(dirname "$MW_PKG_DIR")
MW_ROOTS=${MW_ROOTS:-/var/cache/millwright-dev/roots}
MW_OUT=${MW_OUT:-$MW_PKG_DIR/out}
MW_SUITE=bookworm
MW_PROG=${MW_PROG:-$(basename "$0" .sh)}

mw_log() { printf '%s: %s\n' "$MW_PROG" "$*" >&2; }
mw_die() { mw_log "FAIL: $*"; exit 1; }
mw_now() { date +%s.%N; }
mw_since() { awk -v a="$1" -v b="$(mw_now)" 'BEGIN { printf "%.1f", b - a }'; }

mw_require_root() { [ "$(id -u)" = 0 ] || mw_die "must run as root (debootstrap, chroot, mounts)"; }

mw_require_cmds() {
  local c missing=()
  for c in "$@"; do command -v "$c" >/dev/null 2>&1 || missing+=("$c"); done
  [ ${#missing[@]} -eq 0 ] || mw_die "missing commands: ${missing[*]} (run: bash scripts/setup-host.sh)"
}

# The upstream version, from agent/__init__.py, without importing the package.
mw_version() {
  local v
  v=$(sed -n "s/^__version__[[:space:]]*=[[:space:]]*[\"']\([^\"']*\)[\"'].*/\1/p" "$MW_REPO/agent/__init__.py" | head -n1)
  [ -n "$v" ] || mw_die "no __version__ in agent/__init__.py"
  printf '%s\n' "$v"
}

# The newest .deb in $MW_OUT (or $MW_DEB when set).
mw_find_deb() {
  if [ -n "${MW_DEB:-}" ]; then
    [ -f "$MW_DEB" ] || mw_die "MW_DEB=$MW_DEB does not exist"
    readlink -f "$MW_DEB"; return
  fi
  ls -t "$MW_OUT"/millwright_*_all.deb 2>/dev/null | head -n1
}

# Use the given .deb, or build one from the current tree (without lintian: `make deb`
# lints). Prints the path.
mw_deb_or_build() {
  local deb
  deb=$(mw_find_deb)
  if [ -z "${MW_DEB:-}" ]; then
    mw_log "building the package from the current tree"
    bash "$MW_PKG_DIR/build.sh" --no-lint >&2
    deb=$(mw_find_deb)
  fi
  [ -n "$deb" ] && [ -f "$deb" ] || mw_die "no .deb to test"
  printf '%s\n' "$deb"
}

# Write to stdout a tar of what tests/unit needs from the checkout, except agent/ (the
# tests must import the installed package): the tests, pytest's config, and the files
# tests read relative to the repo (README.md, CHANGELOG.md, docs/, configs/, bpf/, the broker
# examples).
mw_tests_tar() {
  local p paths=()
  for p in tests/__init__.py tests/conftest.py tests/support tests/unit pyproject.toml README.md CHANGELOG.md docs configs bpf packaging/debian/examples; do
    [ -e "$MW_REPO/$p" ] && paths+=("$p")
  done
  tar -C "$MW_REPO" --exclude=__pycache__ --exclude='*.pyc' -cf - "${paths[@]}"
}

# --- apt sources: the host's Debian mirror, as configured on this machine -------------

# Print "<mirror-uri> <security-uri>" taken from the host's sources (one-line and deb822),
# falling back to deb.debian.org.
mw_host_mirrors() {
  local files=() f mirror="" security=""
  [ -f /etc/apt/sources.list ] && files+=(/etc/apt/sources.list)
  for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && files+=("$f")
  done
  if [ ${#files[@]} -gt 0 ]; then
    read -r mirror security < <(awk '
      function pick(uri, suites,   n, i, s) {
        n = split(suites, s, /[ \t]+/)
        for (i = 1; i <= n; i++) {
          if (s[i] == "bookworm" && m == "") m = uri
          if (s[i] == "bookworm-security" && sec == "") sec = uri
        }
      }
      function flush(   u) {       # end of a deb822 stanza
        if (types ~ /(^| )deb( |$)/ && enabled) { split(uris, u, /[ \t]+/); pick(u[1], suites) }
        uris = ""; suites = ""; types = ""; enabled = 1
      }
      BEGIN { enabled = 1 }
      FNR == 1 { flush() }
      /^[ \t]*deb[ \t]/ {            # one-line format: deb [opts] URI SUITE COMPONENTS
        line = $0; sub(/\[[^]]*\]/, "", line); split(line, w, /[ \t]+/)
        i = (w[1] == "") ? 2 : 1; pick(w[i + 1], w[i + 2]); next
      }
      /^[ \t]*$/ { flush(); next }
      /^Types:/ { types = $0; sub(/^Types:[ \t]*/, "", types) }
      /^URIs:/ { uris = $0; sub(/^URIs:[ \t]*/, "", uris) }
      /^Suites:/ { suites = $0; sub(/^Suites:[ \t]*/, "", suites) }
      /^Enabled:[ \t]*no/ { enabled = 0 }
      END { flush(); print (m == "" ? "-" : m), (sec == "" ? "-" : sec) }
    ' "${files[@]}" 2>/dev/null || echo "- -")
  fi
  [ -n "$mirror" ] && [ "$mirror" != - ] || mirror=http://deb.debian.org/debian
  [ -n "$security" ] && [ "$security" != - ] || security=http://deb.debian.org/debian-security
  printf '%s %s\n' "$mirror" "$security"
}

# --- entering a root --------------------------------------------------------------------

# mw_in_root ROOT ARCH CMD...: run CMD inside ROOT in a private mount namespace with
# /proc, /sys (read-only), a minimal /dev and the arch's apt cache. stdin is passed on.
mw_in_root() {
  local root=$1 arch=$2; shift 2
  local cache="$MW_ROOTS/apt-cache-$arch"
  mkdir -p "$cache/partial"
  unshare --mount --propagation private -- /bin/bash -euo pipefail -c '
    root=$1 cache=$2; shift 2
    mount -t proc proc "$root/proc"
    mount -t sysfs -o ro sysfs "$root/sys"
    mount -t tmpfs -o mode=0755,size=16m,nosuid tmpfs "$root/dev"
    for n in "null 1 3" "zero 1 5" "full 1 7" "random 1 8" "urandom 1 9" "tty 5 0"; do
      read -r name maj min <<<"$n"; mknod -m 0666 "$root/dev/$name" c "$maj" "$min"
    done
    ln -s /proc/self/fd "$root/dev/fd"; ln -s /proc/self/fd/0 "$root/dev/stdin"
    ln -s /proc/self/fd/1 "$root/dev/stdout"; ln -s /proc/self/fd/2 "$root/dev/stderr"
    mkdir -p "$root/dev/pts" "$root/dev/shm"
    mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts "$root/dev/pts"
    ln -s pts/ptmx "$root/dev/ptmx"
    mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$root/dev/shm"
    mkdir -p "$root/var/cache/apt/archives"
    mount --bind "$cache" "$root/var/cache/apt/archives"
    exec chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
      LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive TERM=dumb \
      ${http_proxy:+http_proxy=$http_proxy} "$@"
  ' mw-root "$root" "$cache" "$@"
}

# A shell script run inside the root (from stdin or a string).
mw_root_sh() { local root=$1 arch=$2; shift 2; mw_in_root "$root" "$arch" /bin/bash -euo pipefail -c "$*"; }

mw_assert_no_mounts() {
  local dir=$1
  if awk -v d="$dir" '$2 == d || index($2, d "/") == 1 { found = 1 } END { exit !found }' /proc/self/mounts; then
    mw_die "mounts left under $dir"
  fi
}

# --- the pristine root ------------------------------------------------------------------

mw_apt_sources() {  # deb822 sources for the root, from the host's mirrors
  local mirror security
  read -r mirror security < <(mw_host_mirrors)
  cat <<EOF
Types: deb
URIs: $mirror
Suites: $MW_SUITE $MW_SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security
Suites: $MW_SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
}

# What the pristine root holds besides minbase: systemd, as on every real target (the
# unit is verified against it, and the package's scripts run with it present).
MW_ROOT_INCLUDE=systemd

# Make sure the pristine tarball for ARCH exists (debootstrap --variant=minbase; foreign
# arches via --foreign + second stage under qemu-user-static). Prints its path. The name
# carries a hash of the recipe (this function, the sources, the include list), so a
# changed recipe builds a new root instead of reusing a stale one.
mw_pristine() {
  local arch=$1 tarball recipe
  recipe=$( { declare -f mw_pristine mw_apt_sources; echo "$MW_ROOT_INCLUDE"; } | sha256sum | cut -c1-10)
  tarball="$MW_ROOTS/$MW_SUITE-$arch-$recipe.tar"
  mkdir -p "$MW_ROOTS"
  exec 9>"$MW_ROOTS/.lock-$arch"
  flock 9
  if [ -f "$tarball" ] && [ -z "${MW_FRESH_ROOT:-}" ]; then
    exec 9>&-
    printf '%s\n' "$tarball"; return
  fi
  # Under the lock nobody else is bootstrapping this arch: leftovers are from killed runs,
  # and tarballs of other recipes are stale.
  rm -rf --one-file-system "$MW_ROOTS/debootstrap-$arch".*
  rm -f "$MW_ROOTS/$MW_SUITE-$arch"*.tar "$MW_ROOTS/$MW_SUITE-$arch"*.tar.tmp
  local t0 tmp mirror security host_arch
  t0=$(mw_now)
  host_arch=$(dpkg --print-architecture)
  read -r mirror security < <(mw_host_mirrors)
  tmp=$(mktemp -d "$MW_ROOTS/debootstrap-$arch.XXXXXX")
  chmod 0755 "$tmp"
  trap 'rm -rf --one-file-system "$tmp" "$tmp.log"' EXIT
  mw_log "debootstrap $MW_SUITE/$arch (minbase + $MW_ROOT_INCLUDE) from $mirror (cached as $(basename "$tarball"))"
  mkdir -p "$MW_ROOTS/debootstrap-cache-$arch"
  local -a opts=(--variant=minbase --include="$MW_ROOT_INCLUDE" --arch="$arch"
                 --cache-dir="$MW_ROOTS/debootstrap-cache-$arch")
  if [ "$arch" != "$host_arch" ]; then
    mw_binfmt "$arch"
    debootstrap "${opts[@]}" --foreign "$MW_SUITE" "$tmp" "$mirror" >"$tmp.log" 2>&1 ||
      { tail -n 20 "$tmp.log" >&2; mw_die "debootstrap (first stage) failed"; }
    # The second stage runs the foreign binaries (dpkg, maintainer scripts) under qemu.
    # It needs /proc; run it in a private mount namespace like every other root command.
    unshare --mount --propagation private -- /bin/sh -c '
      mount -t proc proc "$1/proc" && exec chroot "$1" /debootstrap/debootstrap --second-stage' \
      mw "$tmp" >>"$tmp.log" 2>&1 ||
      { tail -n 20 "$tmp.log" >&2; mw_die "debootstrap (second stage) failed"; }
  else
    debootstrap "${opts[@]}" "$MW_SUITE" "$tmp" "$mirror" >"$tmp.log" 2>&1 ||
      { tail -n 20 "$tmp.log" >&2; mw_die "debootstrap failed"; }
  fi
  mw_assert_no_mounts "$tmp"
  mw_apt_sources > "$tmp/etc/apt/sources.list.d/debian.sources"
  : > "$tmp/etc/apt/sources.list"
  # Services must never start inside a test root.
  printf '#!/bin/sh\nexit 101\n' > "$tmp/usr/sbin/policy-rc.d"; chmod 0755 "$tmp/usr/sbin/policy-rc.d"
  rm -rf "$tmp/var/cache/apt/archives/"*.deb "$tmp/debootstrap"
  tar -C "$tmp" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  rm -rf --one-file-system "$tmp" "$tmp.log"
  trap - EXIT
  exec 9>&-
  mw_log "pristine $arch root cached in $(mw_since "$t0")s ($(du -h "$tarball" | cut -f1))"
  printf '%s\n' "$tarball"
}

# Register qemu-user-static for ARCH with binfmt_misc (host-wide, like setup-host's tracefs
# mount; left registered). The F flag makes the kernel open the interpreter at registration,
# so nothing needs to be copied into the root.
mw_binfmt() {
  local arch=$1 name
  case "$arch" in
    arm64) name=qemu-aarch64 ;;
    armhf) name=qemu-arm ;;
    *) mw_die "no qemu binfmt name for $arch" ;;
  esac
  if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc ||
      mw_die "cannot mount binfmt_misc (kernel without CONFIG_BINFMT_MISC?)"
  fi
  if [ ! -e "/proc/sys/fs/binfmt_misc/$name" ]; then
    mw_require_cmds update-binfmts
    update-binfmts --enable "$name" >/dev/null 2>&1 || update-binfmts --import "$name" >/dev/null 2>&1 ||
      mw_die "cannot register $name with binfmt_misc (is qemu-user-static installed?)"
  fi
  grep -q '^enabled' "/proc/sys/fs/binfmt_misc/$name" || mw_die "$name is registered but disabled"
  grep -q '^flags:.*F' "/proc/sys/fs/binfmt_misc/$name" ||
    mw_die "$name is registered without the F flag; chroots cannot find the interpreter"
}

# A cached second layer: the pristine root plus the packages a .deb depends on
# (`apt-get satisfy` on its Depends field, so versions and alternatives resolve exactly as
# apt would resolve them for the .deb) and EXTRA packages. The arm64 test uses it: under
# qemu, installing python3 and the dependencies takes minutes, and they are not what the
# test is about. The key is the base root, the Depends field and EXTRA, so a changed
# dependency builds a new layer; a layer older than MW_LAYER_MAX_DAYS (7) is rebuilt too.
# mw_layer ARCH DEPENDS [EXTRA...]; prints the tarball's path.
mw_layer() {
  local arch=$1 depends=$2; shift 2
  local base key tarball
  base=$(mw_pristine "$arch")
  key=$(printf '%s\n' "$(basename "$base")" "$depends" "$@" | sha256sum | cut -c1-10)
  tarball="$MW_ROOTS/$MW_SUITE-$arch-deps-$key.tar"
  exec 7>"$MW_ROOTS/.lock-$arch-deps"
  flock 7
  if [ -f "$tarball" ] && [ -z "$(find "$tarball" -mtime +"${MW_LAYER_MAX_DAYS:-7}")" ]; then
    exec 7>&-
    printf '%s\n' "$tarball"; return
  fi
  rm -f "$MW_ROOTS/$MW_SUITE-$arch-deps-"*.tar "$MW_ROOTS/$MW_SUITE-$arch-deps-"*.tar.tmp
  local t0 tmp
  t0=$(mw_now)
  mkdir -p "$MW_ROOTS/work"
  tmp=$(mktemp -d "$MW_ROOTS/work/layer-$arch.XXXXXX")
  trap 'rm -rf --one-file-system "$tmp"' EXIT
  tar -C "$tmp" -xf "$base"
  chmod 0755 "$tmp"
  cp -L /etc/resolv.conf "$tmp/etc/resolv.conf" 2>/dev/null || true
  mw_log "building the $arch dependency layer (Depends: $depends${1:+; extra: $*})"
  mw_in_root "$tmp" "$arch" /bin/bash -euo pipefail -c '
    apt-get update -qq -o Acquire::Retries=3
    apt-get satisfy -y -qq --no-install-recommends -o Acquire::Retries=3 "$1" >/tmp/layer.log 2>&1 ||
      { tail -n 30 /tmp/layer.log; exit 1; }
    shift
    if [ $# -gt 0 ]; then
      apt-get install -y -qq --no-install-recommends -o Acquire::Retries=3 "$@" >>/tmp/layer.log 2>&1 ||
        { tail -n 30 /tmp/layer.log; exit 1; }
    fi
    rm -f /tmp/layer.log' layer "$depends" "$@" || mw_die "building the $arch dependency layer failed"
  mw_assert_no_mounts "$tmp"
  tar -C "$tmp" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  rm -rf --one-file-system "$tmp"
  trap - EXIT
  exec 7>&-
  mw_log "$arch dependency layer cached in $(mw_since "$t0")s ($(du -h "$tarball" | cut -f1))"
  printf '%s\n' "$tarball"
}

# Extract a fresh root into a new work dir: the pristine root for ARCH, or TARBALL (a
# layer from mw_layer). Prints the path; the caller adds it to MW_CLEANUP_DIRS.
mw_fresh_root() {
  local arch=$1 tarball=${2:-} dir
  [ -n "$tarball" ] || tarball=$(mw_pristine "$arch")
  mkdir -p "$MW_ROOTS/work"
  # Work roots of runs that were SIGKILLed (no cleanup) are removed after a day.
  find "$MW_ROOTS/work" -mindepth 1 -maxdepth 1 -type d -mmin +1440 \
    -exec rm -rf --one-file-system {} + 2>/dev/null || true
  dir=$(mktemp -d "$MW_ROOTS/work/$MW_PROG.XXXXXX")
  tar -C "$dir" -xf "$tarball"
  chmod 0755 "$dir"   # the root's /: _apt and the job user must traverse it
  cp -L /etc/resolv.conf "$dir/etc/resolv.conf" 2>/dev/null || true
  # debootstrap writes no /etc/hosts; every installed system has one (localhost).
  [ -s "$dir/etc/hosts" ] || printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' > "$dir/etc/hosts"
  printf '%s\n' "$dir"
}

MW_CLEANUP_DIRS=()
mw_cleanup() {
  local rc=$? d
  for d in "${MW_CLEANUP_DIRS[@]}"; do
    [ -n "$d" ] && [ -d "$d" ] || continue
    # Mounts live in per-command namespaces; if one were visible here, refuse to delete.
    if awk -v d="$d" '$2 == d || index($2, d "/") == 1 { f = 1 } END { exit !f }' /proc/self/mounts; then
      mw_log "WARNING: mounts under $d; not deleting it"
      continue
    fi
    if [ -n "${MW_KEEP:-}" ]; then mw_log "kept $d (MW_KEEP set)"; continue; fi
    rm -rf --one-file-system "$d"
  done
  return $rc
}
