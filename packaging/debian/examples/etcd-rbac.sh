#!/bin/sh
# etcd users and roles for Millwright: every agent its own user, confined to its cluster.
#
#   etcd-rbac.sh init                       root user (password on stdin), then `auth enable`
#   etcd-rbac.sh agent CLUSTER AGENT_ID     the agent's user (password on stdin); prints its name
#   etcd-rbac.sh ops USER CLUSTER...        a cloud/operator user (password on stdin) for these clusters
#   etcd-rbac.sh revoke CLUSTER AGENT_ID    delete the agent's user and end its etcd session
#
# Role millwright-CLUSTER may read the key prefix /millwright/CLUSTER/ and write all of it
# but the staged rollouts' keys, /millwright/CLUSTER/rollouts/, and nothing else: a
# gateway's credentials cannot touch another cluster's jobs, records or shards. Each agent
# also holds role rollouts.CLUSTER.AGENT_ID, which may write /millwright/CLUSTER/rollouts/AGENT_ID/
# alone: its own rollout claims, starts, outcomes and abort marks, so no gateway can delete
# or forge another's and a rollout's limits hold against one (agent/jobs/rollout.py).
# Agent AGENT_ID of CLUSTER logs in as user agent.CLUSTER.AGENT_ID (a cluster name has no
# dot, so names never collide across clusters) holding only those roles; put the name and
# its password in that agent's agent.yaml (etcd.username, etcd.password; the file 0600,
# with https:// endpoints and etcd.tls.ca). `revoke` takes one agent out: its user is
# deleted (etcd drops its tokens at once) and the lease its session holds is revoked, so
# its shards move to the other agents now rather than when the lease would expire; the
# other agents, with their own users, go on; its rollout keys stay (its abort marks and
# outcomes still count; delete them as root with `etcdctl del --prefix
# /millwright/CLUSTER/rollouts/AGENT_ID/` once its jobs are done). Running `agent` again for an existing agent
# sets a new password (rotation: update its agent.yaml, restart it). Running it again after
# an upgrade also narrows a role made by an older version of this script (it wrote all of
# the cluster's prefix, rollouts included).
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

cluster_role() {   # cluster: its role, read on its prefix, write on all of it but rollouts/
    role="millwright-$1"
    etcdctl role get "$role" >/dev/null 2>&1 || etcdctl role add "$role" >/dev/null
    # (granting read on the very range an older version granted readwrite replaces that)
    etcdctl role grant-permission "$role" --prefix=true read "/millwright/$1/" >/dev/null
    etcdctl role grant-permission "$role" readwrite "/millwright/$1/" "/millwright/$1/rollouts/" >/dev/null
    etcdctl role grant-permission "$role" readwrite "/millwright/$1/rollouts0" "/millwright/${1}0" >/dev/null
}

agent_rollout_role() {   # cluster agent: the agent's own rollout keys, read-write
    role="rollouts.$1.$2"
    etcdctl role get "$role" >/dev/null 2>&1 || etcdctl role add "$role" >/dev/null
    etcdctl role grant-permission "$role" --prefix=true readwrite "/millwright/$1/rollouts/$2/" >/dev/null
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
        agent_rollout_role "$1" "$2"
        set_user "$user" "$pw"
        # exactly its cluster's role and its own rollout role, whatever it held before
        for r in $(etcdctl user get "$user" | sed -n 's/^Roles: //p'); do
            [ "$r" = "millwright-$1" ] || [ "$r" = "rollouts.$1.$2" ] || etcdctl user revoke-role "$user" "$r" >/dev/null
        done
        etcdctl user grant-role "$user" "millwright-$1" >/dev/null 2>&1 || true   # already granted is fine
        etcdctl user grant-role "$user" "rollouts.$1.$2" >/dev/null 2>&1 || true
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
        echo "$user: read on $(for c in "$@"; do printf '/millwright/%s/ ' "$c"; done)(write but rollouts/)"
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
        etcdctl role delete "rollouts.$1.$2" >/dev/null 2>&1 || true   # gone already is fine
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
