#!/usr/bin/env bash
# Prepare a Debian 12 / Ubuntu 22.04+ host (as root) for `make test` and `make demo`:
# distribution packages, the kernel-headers link BCC needs, and a mounted tracefs.
# Idempotent and fast when everything is already there (a stamp keyed on this file).
set -euo pipefail

PKGS=(
  etcd-server etcd-client mosquitto mosquitto-clients
  python3 python3-etcd3 python3-paho-mqtt python3-psutil python3-prometheus-client
  python3-yaml python3-croniter python3-bpfcc bpfcc-tools python3-pytest
  python3-hypothesis python3-cryptography python3-apscheduler python3-tz
  python3-pip  # make test-cloud-paho2: paho-mqtt 2.x into .cache/paho2 (tests only)
  mksh  # the package's Recommends: lksh, the armed launcher (agent/execute/armed.py); kernel tests need it
  nftables iproute2 procps psmisc
  # packaging (make deb, tests/packaging): build, lint, chroot install tests, arm64 emulation
  debhelper dh-python dpkg-dev fakeroot help2man lintian debootstrap qemu-user-static binfmt-support
  systemd
)

log() { printf 'setup-host: %s\n' "$*" >&2; }

if [ "$(id -u)" != 0 ]; then
  log "must run as root (installs packages, mounts tracefs)"; exit 1
fi

stamp=/var/lib/millwright-dev/setup.stamp
want=$(sha256sum "$0" | cut -c1-16)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

# BCC reads generated headers from build/ and the generic ones from source/ (Debian splits
# them into linux-headers-*-<arch> and linux-headers-*-common).
headers_ok() {
  local m="/lib/modules/$(uname -r)"
  [ -e "$m/build/include/generated/autoconf.h" ] &&
    { [ -e "$m/build/include/linux/kconfig.h" ] || [ -e "$m/source/include/linux/kconfig.h" ]; }
}

if [ ${#missing[@]} -gt 0 ] || ! headers_ok; then
  export DEBIAN_FRONTEND=noninteractive
  log "installing: ${missing[*]:-(none)} + kernel headers"
  apt-get update -qq
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # The distribution's services must not squat the ports tests and demos use. Only the
  # packaged daemons are stopped (systemd, or their init script's pid file without it):
  # never every etcd or mosquitto of the host, which may be a running test suite's own.
  for svc in etcd mosquitto; do
    systemctl disable --now "$svc" >/dev/null 2>&1 || true
    if [ ! -d /run/systemd/system ] && [ -x "/etc/init.d/$svc" ]; then
      "/etc/init.d/$svc" stop >/dev/null 2>&1 || true
    fi
  done
fi

# promtool (make test checks configs/alerts.yaml with it) comes only with Debian's Prometheus
# server, which must not run here (port 9090, for good): it is installed alone, under a
# policy-rc.d that forbids starting daemons (Debian's policy-rc.d interface: 101; one already
# there is left as it is), and not enabled at boot. A Prometheus the host had is its own.
if ! dpkg-query -W -f='${Status}' prometheus 2>/dev/null | grep -q "install ok installed"; then
  export DEBIAN_FRONTEND=noninteractive
  log "installing: prometheus (for promtool; its server kept off)"
  [ ${#missing[@]} -gt 0 ] || apt-get update -qq
  policy=/usr/sbin/policy-rc.d
  own_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# setup-host.sh: no daemon starts while promtool is installed\nexit 101\n' > "$policy"
    chmod 0755 "$policy"
    own_policy=1
    trap 'rm -f "$policy"' EXIT
  fi
  apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  if [ "$own_policy" = 1 ]; then rm -f "$policy"; trap - EXIT; fi
  systemctl disable prometheus >/dev/null 2>&1 || true
fi

# BCC needs kernel headers at /lib/modules/$(uname -r)/build. When the running kernel has
# no matching headers package (this CI kernel), Debian's closest linux-headers-*-amd64 works
# for tracepoint programs; link it. On a Jetson, L4T's headers package plays that role.
kver=$(uname -r)
if ! headers_ok; then
  arch=$(dpkg --print-architecture)
  if apt-cache show "linux-headers-$kver" >/dev/null 2>&1; then
    apt-get install -y -qq "linux-headers-$kver" >/dev/null
  else
    meta="linux-headers-$arch"
    apt-get install -y -qq "$meta" >/dev/null
    hdr=$(ls -d /usr/src/linux-headers-*-"$arch" 2>/dev/null | sort -V | tail -n1)
    [ -n "$hdr" ] || { log "no linux-headers-*-$arch found after install"; exit 1; }
    common=$(sed -n 's/^include \(.*\)\/Makefile$/\1/p' "$hdr/Makefile" | head -n1)
    [ -d "$common" ] || common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n1)
    mkdir -p "/lib/modules/$kver"
    ln -sfn "$hdr" "/lib/modules/$kver/build"
    ln -sfn "$common" "/lib/modules/$kver/source"
    log "linked /lib/modules/$kver/{build,source} -> $hdr, $common"
  fi
fi

if [ ! -e /sys/kernel/tracing/events ]; then
  mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null || true
fi
if [ ! -e /sys/kernel/debug/tracing/events ] && [ -d /sys/kernel/debug ]; then
  mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null || true
fi

# dev tools: pytest and hypothesis come from Debian (PKGS above); ruff and mypy, which
# bookworm lacks or ships too old, from PyPI into the project's .cache/lint
bash "$(dirname "$0")/lint-tools.sh"

mkdir -p "$(dirname "$stamp")"; echo "$want" > "$stamp"
log "ready (kernel $kver, headers $(readlink -f /lib/modules/$kver/build))"
