#!/bin/sh
# etcd role-based access for Millwright: one role per cluster, limited to its prefix.
#
#   etcd-rbac.sh CLUSTER USER PASSWORD [ROOT_PASSWORD]
#
# Creates (idempotently) the role millwright-CLUSTER with read/write on the key prefix
# /millwright/CLUSTER/ only, the user USER with PASSWORD holding that role, and, when
# ROOT_PASSWORD is given, the root user and `auth enable`. Give every agent of the
# cluster these credentials (etcd.username/etcd.password in agent.yaml, with https://
# endpoints and etcd.tls.ca: a password over plain http:// is a config error). Jobs are
# never given credentials: they run as the template's user and cannot read agent.yaml
# (0640 root) or the keys file (0600 root).
#
# etcdctl options come from the environment, e.g.
#   ETCDCTL_API=3 ETCDCTL_ENDPOINTS=https://10.0.0.5:2379 ETCDCTL_CACERT=/etc/etcd/ca.pem \
#   ETCDCTL_USER=root:ROOTPW etcd-rbac.sh plant-a plant-a-agents 's3cret'
set -eu

if [ $# -lt 3 ]; then
    echo "usage: $0 CLUSTER USER PASSWORD [ROOT_PASSWORD]" >&2
    exit 2
fi
cluster=$1 user=$2 password=$3 root_password=${4:-}
case "$cluster" in
    *[!A-Za-z0-9_-]*|"") echo "cluster must match [A-Za-z0-9_-]{1,64}" >&2; exit 2 ;;
esac
export ETCDCTL_API=3
role="millwright-$cluster"
prefix="/millwright/$cluster/"

if [ -n "$root_password" ]; then
    # before auth is enabled no credentials are needed; afterwards, use root
    if ! env -u ETCDCTL_USER etcdctl user get root >/dev/null 2>&1 && \
       ! env -u ETCDCTL_USER etcdctl --user "root:$root_password" user get root >/dev/null 2>&1; then
        printf '%s\n' "$root_password" | env -u ETCDCTL_USER etcdctl user add root --interactive=false >/dev/null
    fi
    export ETCDCTL_USER="root:$root_password"
fi
etcdctl role get "$role" >/dev/null 2>&1 || etcdctl role add "$role" >/dev/null
etcdctl role grant-permission "$role" --prefix=true readwrite "$prefix" >/dev/null
if etcdctl user get "$user" >/dev/null 2>&1; then
    printf '%s\n' "$password" | etcdctl user passwd "$user" --interactive=false >/dev/null
else
    printf '%s\n' "$password" | etcdctl user add "$user" --interactive=false >/dev/null
fi
etcdctl user grant-role "$user" "$role" >/dev/null
if [ -n "$root_password" ]; then
    etcdctl auth enable >/dev/null 2>&1 || true   # already enabled is fine
fi
echo "role $role: readwrite $prefix; user $user"
