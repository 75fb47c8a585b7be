#!/usr/bin/env bash
# Upgrade test: install version N in a clean Debian 12 root, change the conffile and put
# state and audit files in place, then install N+1 (the same tree rebuilt as
# "<version>+upgtest1", whose shipped agent.yaml also differs, the hard conffile case).
# Checks: the operator's agent.yaml is kept (the new default lands as .dpkg-dist), state,
# audit files and the audit key are intact, operator-changed directory modes are kept, the
# job user is unchanged, and the service is restarted by the new postinst.
#
#   packaging/test-upgrade.sh [--deb FILE]      (N; default: built from the tree)
#
# Service restart: the root has systemd installed but not running. The test marks systemd
# as running (/run/systemd/system) so the maintainer scripts take their systemd path, and
# installs a policy-rc.d that records every action deb-systemd-invoke asks for and denies
# it (exit 101). Install must ask for "start", the upgrade for "restart".
set -euo pipefail
while [ $# -gt 0 ]; do
  case "$1" in
    --deb) export MW_DEB=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "test-upgrade: unknown argument $1" >&2; exit 2 ;;
  esac
done
MW_PROG=test-upgrade
source "$(dirname "$0")/lib.sh"
mw_require_root
mw_require_cmds debootstrap unshare chroot flock dpkg-deb

trap mw_cleanup EXIT
trap 'exit 130' INT TERM HUP
t_start=$(mw_now)
arch=$(dpkg --print-architecture)

deb_n=$(mw_deb_or_build)
v_n=$(dpkg-deb -f "$deb_n" Version)
v_n1="$v_n+upgtest1"
dpkg --compare-versions "$v_n1" gt "$v_n" || mw_die "$v_n1 does not sort after $v_n"

# N+1: the same tree, a higher version and a changed default config.
scratch=$(mktemp -d "${TMPDIR:-/tmp}/mw-upgrade.XXXXXX")
MW_CLEANUP_DIRS+=("$scratch")
{ cat "$MW_REPO/configs/agent.yaml"; printf '\n# default added in %s (upgrade test)\n' "$v_n1"; } > "$scratch/agent.yaml"
t0=$(mw_now)
deb_n1=$(bash "$MW_PKG_DIR/build.sh" --no-lint --version "$v_n1" --config "$scratch/agent.yaml" --out "$scratch/out" 2>"$scratch/build.log") ||
  { cat "$scratch/build.log" >&2; mw_die "building N+1 ($v_n1) failed"; }
mw_log "built N+1 $(basename "$deb_n1") in $(mw_since "$t0")s"

# The dependencies come from the cached layer (test-install.sh proves they install from
# scratch); this test is about what happens to millwright itself between N and N+1.
root=$(mw_fresh_root "$arch" "$(mw_layer "$arch" "$(dpkg-deb -f "$deb_n" Depends)")")
MW_CLEANUP_DIRS+=("$root")
cp "$deb_n" "$deb_n1" "$root/tmp/"
n=$(basename "$deb_n") n1=$(basename "$deb_n1")

mw_root_sh "$root" "$arch" '
mkdir -p /run/systemd/system
cat > /usr/sbin/policy-rc.d <<"EOF"
#!/bin/sh
echo "$*" >> /var/log/policy-rc.d.log
exit 101
EOF
chmod 0755 /usr/sbin/policy-rc.d
apt-get update -qq -o Acquire::Retries=3
' || mw_die "preparing the root failed"

t0=$(mw_now)
mw_root_sh "$root" "$arch" "cd /tmp && apt-get install -y -qq --no-install-recommends ./$n >/tmp/install-n.log 2>&1 ||
  { tail -n 40 /tmp/install-n.log; exit 1; }" || mw_die "installing N ($v_n) failed"
t_install=$(mw_since "$t0")
mw_log "installed N ($v_n) in ${t_install}s"

# The operator's changes and the agent's data.
mw_root_sh "$root" "$arch" '
fail() { echo "CHECK FAILED: $*" >&2; exit 1; }
grep -q "millwright.service start" /var/log/policy-rc.d.log || fail "install did not start the service: $(cat /var/log/policy-rc.d.log)"
sed -i "s/^capacity: .*/capacity: 2.5                    # edited by the operator/" /etc/millwright/agent.yaml
sed -i "/^etcd:/a\\  insecure: true                 # edited by the operator (a lab etcd)" /etc/millwright/agent.yaml
sed -i "/^mqtt:/a\\  insecure: true                 # edited by the operator (a lab broker)" /etc/millwright/agent.yaml
grep -q "^capacity: 2.5" /etc/millwright/agent.yaml || fail "could not edit the conffile"
echo "cloud-1: {alg: hmac-sha256, secret: c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNlY3JldC0xMjM=}" > /etc/millwright/keys.yaml
chmod 0600 /etc/millwright/keys.yaml
mkdir -p /var/lib/millwright/outbox
head -c 4096 /dev/urandom > /var/lib/millwright/outbox/000001.msg
printf "{\"v\":1,\"seq\":1}\n" > /var/log/millwright/audit/audit-000001.jsonl
chmod 0700 /var/lib/millwright          # an operator tightening the mode
id -u millwright-jobs > /tmp/uid.before
(cd / && sha256sum etc/millwright/agent.yaml etc/millwright/keys.yaml etc/millwright/audit.key \
   var/lib/millwright/outbox/000001.msg var/log/millwright/audit/audit-000001.jsonl) > /tmp/sums.before
: > /var/log/policy-rc.d.log
' || mw_die "preparing the upgrade failed"

t0=$(mw_now)
mw_root_sh "$root" "$arch" "cd /tmp && apt-get install -y -qq --no-install-recommends \
  -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold ./$n1 >/tmp/install-n1.log 2>&1 ||
  { tail -n 40 /tmp/install-n1.log; exit 1; }" || mw_die "upgrading to N+1 ($v_n1) failed"
t_upgrade=$(mw_since "$t0")
mw_log "upgraded to N+1 ($v_n1) in ${t_upgrade}s"

mw_root_sh "$root" "$arch" '
fail() { echo "CHECK FAILED: $*" >&2; exit 1; }
[ "$(dpkg-query -W -f="\${Version}" millwright)" = "'"$v_n1"'" ] || fail "not upgraded"
millwright --version | grep -qF "millwright '"$v_n1"' " || fail "--version after the upgrade: $(millwright --version), want '"$v_n1"'"
cd / && sha256sum -c --quiet /tmp/sums.before || fail "config, keys, audit key, state or audit log changed by the upgrade"
grep -q "^capacity: 2.5" /etc/millwright/agent.yaml || fail "operator conffile change lost"
grep -q "upgrade test" /etc/millwright/agent.yaml.dpkg-dist || fail "the new default config is not in agent.yaml.dpkg-dist"
millwright config check /etc/millwright/agent.yaml >/dev/null || fail "kept config no longer passes config check"
[ "$(stat -c %a /var/lib/millwright)" = 700 ] || fail "operator mode of /var/lib/millwright reset"
[ "$(id -u millwright-jobs)" = "$(cat /tmp/uid.before)" ] || fail "job user changed"
[ -e /etc/systemd/system/multi-user.target.wants/millwright.service ] || fail "unit no longer enabled"
grep -q "millwright.service restart" /var/log/policy-rc.d.log || fail "upgrade did not restart the service (asked: $(cat /var/log/policy-rc.d.log))"
grep -q "millwright.service stop" /var/log/policy-rc.d.log && fail "upgrade stopped the service before unpacking (want restart after)"
grep -q "deb-systemd-invoke \$_dh_action" /var/lib/dpkg/info/millwright.postinst || fail "postinst has no restart hook"
echo "  upgrade: conffile kept (+ .dpkg-dist), state/audit/keys intact, modes kept, service restarted"
' || mw_die "upgrade checks failed"

mw_log "PASS: install N ${t_install}s, upgrade to N+1 ${t_upgrade}s, total $(mw_since "$t_start")s"
