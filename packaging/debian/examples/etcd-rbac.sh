#!/bin/sh
# etcd users and roles for Millwright: every agent its own user, confined to its cluster.
#
#   etcd-rbac.sh init                       root user (password on stdin), then `auth enable`
#   etcd-rbac.sh agent CLUSTER AGENT_ID     the agent's user (password on stdin); prints its name
#   etcd-rbac.sh ops USER CLUSTER...        a cloud/operator user (password on stdin) for these clusters
#   etcd-rbac.sh revoke CLUSTER AGENT_ID    delete the agent's user and end its etcd session
#
# Role millwright-CLUSTER may read and write the key prefix /millwright/CLUSTER/ and nothing
# else: a gateway's credentials cannot touch another cluster's jobs, records or shards.
# Agent AGENT_ID of CLUSTER logs in as user agent.CLUSTER.AGENT_ID (a cluster name has no
# dot, so names never collide across clusters) holding only that role; put the name and
# its password in that agent's agent.yaml (etcd.username, etcd.password; the file 0600,
# with https:// endpoints and etcd.tls.ca). `revoke` takes one agent out: its user is
# deleted (etcd drops its tokens at once) and the lease its session holds is revoked, so
# its shards move to the other agents now rather than when the lease would expire; the
# other agents, with their own users, go on. Running `agent` again for an existing agent
# sets a new password (rotation: update its agent.yaml, restart it).
#
# Passwords are read from stdin (one line), never from the command line, where every
# local user could read them in /proc. etcdctl options come from the environment; after
# `init`, ETCDCTL_USER=root:ROOT_PASSWORD. For example:
#   export ETCDCTL_API=3 ETCDCTL_ENDPOINTS=https://10.0.0.5:2379 ETCDCTL_CACERT=/etc/etcd/ca.pem
#   printf '%s\n' "$ROOT_PW" | etcd-rbac.sh init
#   export ETCDCTL_USER="root:$ROOT_PW"
#   printf '%s\n' "$GW01_PW" | etcd-rbac.sh agent plant-a gw-01
#   printf '%s\n' "$CLOUD_PW" | etcd-rbac.sh ops cloud plant-a plant-b
#   etcd-rbac.sh revoke plant-a gw-01
set -eu
export ETCDCTL_API=3

usage() {
    sed -n '4,7p' "$0" | sed 's/^#  //' >&2
    exit 2
}

check_cluster() {
    [ ${#1} -le 64 ] || { echo "cluster must match [A-Za-z0-9_-], 1 to 64 characters: $1" >&2; exit 2; }
    case "$1" in
        *[!A-Za-z0-9_-]*|"") echo "cluster must match [A-Za-z0-9_-], 1 to 64 characters: $1" >&2; exit 2 ;;
    esac
}

check_agent() {
    [ ${#1} -le 128 ] || { echo "agent id must match [A-Za-z0-9._-], 1 to 128 characters: $1" >&2; exit 2; }
    case "$1" in
        *[!A-Za-z0-9._-]*|"") echo "agent id must match [A-Za-z0-9._-], 1 to 128 characters: $1" >&2; exit 2 ;;
    esac
}

read_password() {
    IFS= read -r pw || true
    if [ -z "${pw:-}" ]; then
        echo "$1: give the password on stdin (one line)" >&2
        exit 2
    fi
}

set_user() {   # user password: created, or its password changed
    if etcdctl user get "$1" >/dev/null 2>&1; then
        printf '%s\n' "$2" | etcdctl user passwd "$1" --interactive=false >/dev/null
    else
        printf '%s\n' "$2" | etcdctl user add "$1" --interactive=false >/dev/null
    fi
}

cluster_role() {   # cluster: its role, read-write on its prefix only
    role="millwright-$1"
    etcdctl role get "$role" >/dev/null 2>&1 || etcdctl role add "$role" >/dev/null
    etcdctl role grant-permission "$role" --prefix=true readwrite "/millwright/$1/" >/dev/null
}

[ $# -ge 1 ] || usage
cmd=$1
shift
case "$cmd" in
    init)
        [ $# -eq 0 ] || usage
        read_password init
        # before auth is enabled no credentials are needed; once it is, root's are
        if env -u ETCDCTL_USER etcdctl user get root >/dev/null 2>&1; then
            :
        elif ! env -u ETCDCTL_USER etcdctl --user "root:$pw" user get root >/dev/null 2>&1; then
            printf '%s\n' "$pw" | env -u ETCDCTL_USER etcdctl user add root --interactive=false >/dev/null
        fi
        export ETCDCTL_USER="root:$pw"
        etcdctl user grant-role root root >/dev/null 2>&1 || true   # etcd gives it on add; older ones not
        etcdctl auth enable >/dev/null 2>&1 || true                 # already enabled is fine
        etcdctl user get root >/dev/null   # fails here, not later, when the password is wrong
        echo "auth enabled; root user ready"
        ;;
    agent)
        [ $# -eq 2 ] || usage
        check_cluster "$1"
        check_agent "$2"
        read_password agent
        user="agent.$1.$2"
        cluster_role "$1"
        set_user "$user" "$pw"
        # exactly its cluster's role, whatever it held before
        for r in $(etcdctl user get "$user" | sed -n 's/^Roles: //p'); do
            [ "$r" = "millwright-$1" ] || etcdctl user revoke-role "$user" "$r" >/dev/null
        done
        etcdctl user grant-role "$user" "millwright-$1" >/dev/null 2>&1 || true   # already granted is fine
        echo "$user"
        ;;
    ops)
        [ $# -ge 2 ] || usage
        user=$1
        shift
        for c in "$@"; do check_cluster "$c"; done
        read_password ops
        set_user "$user" "$pw"
        for c in "$@"; do
            cluster_role "$c"
            etcdctl user grant-role "$user" "millwright-$c" >/dev/null 2>&1 || true
        done
        echo "$user: read-write on $(for c in "$@"; do printf '/millwright/%s/ ' "$c"; done)"
        ;;
    revoke)
        [ $# -eq 2 ] || usage
        check_cluster "$1"
        check_agent "$2"
        user="agent.$1.$2"
        if etcdctl user get "$user" >/dev/null 2>&1; then
            etcdctl user delete "$user" >/dev/null
            echo "user $user deleted"
        else
            echo "user $user does not exist"
        fi
        # its member key carries the lease of its session, as do the shard keys it owns
        lease=$(etcdctl get "/millwright/$1/members/$2" -w fields | sed -n 's/^"Lease" : \([0-9]*\)$/\1/p')
        if [ -n "$lease" ] && [ "$lease" != 0 ]; then
            etcdctl lease revoke "$(printf '%x' "$lease")" >/dev/null 2>&1 || true   # expired meanwhile is fine
            echo "session lease $(printf '%x' "$lease") revoked: its shards move to the other agents"
        fi
        ;;
    *)
        usage
        ;;
esac
