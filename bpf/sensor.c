// Millwright kernel sensor: exec and tcp signals from tracepoints, attributed to job slots.
//
// Tracepoints only (our target kernels may have no kprobes). No task_struct or sock
// field is ever dereferenced: the headers BCC compiles against may be from another
// kernel version (here 6.1 headers for a 6.18 kernel), so every value comes from a
// tracepoint's own arguments, whose layout BCC generates from the running kernel's
// format files, or from BPF helpers.
//
// Attribution: `tracked` maps a tgid to a job slot (1..MAX_SLOTS-1). The agent fills it
// (via `spawner`, race-free, at fork time, or directly); fork propagates it, exit cleans
// it. A TCP socket whose connect() is issued by a tracked process is remembered in
// `socks` by its kernel address, so that retransmits and resets, which fire in softirq
// context where "current" is unrelated, still land on the right slot.
//
// Aggregation: per-slot and per-endpoint counters live in array maps that userspace
// samples; only exec events and tracked-socket state changes go through perf buffers:
// a job's events through `events`, which wakes the agent's reader at each one (the exec
// policy acts on them), execs outside any job (node activity) through `node_events`,
// whose reader the kernel wakes once per batch of them (agent/signals/polling.py).
//
// The structs below are mirrored in Python in agent/signals/abi.py (one place); the
// loader checks that the sizes agree before the program is used.
//
// Compile-time knobs (cflags, set by agent/signals/loader.py):
//   NODE_ACTIVITY      1: report execs outside any job too; 0: only tracked execs
//   HAVE_EXIT_GROUP_DEAD, HAVE_RR_ADDR: optional tracepoint fields present on this kernel

#include <uapi/linux/ptrace.h>

// Newer kernels (6.10+) type tcp_send_reset's `reason` field with an enum that older
// headers lack; BCC copies the field's type into the generated args struct, so give it
// a definition when the loader found the headers without it.
#ifdef NEED_SK_RST_REASON_ENUM
enum sk_rst_reason { MW_SK_RST_REASON_UNUSED = 0 };
#endif

#ifndef NODE_ACTIVITY
#define NODE_ACTIVITY 1
#endif

#define EV_EXEC 1
#define EV_CONN 2

#define FNAME_LEN 256
#define ARG_LEN 128
#define ARGS_BUF 1024
#define MAX_ARGS 20

#define EXEC_ARGV_TRUNCATED 1
#define EXEC_ARGV_MISSING 2

#define MAX_SLOTS 1024
#define MAX_TRACKED 8192
#define MAX_SOCKS 8192
#define MAX_EPS 64

#define AF_INET_ 2
#define AF_INET6_ 10
#define IPPROTO_TCP_ 6
#define TCP_ESTABLISHED_ 1
#define TCP_SYN_SENT_ 2
#define TCP_CLOSE_ 7

// A retransmit streak continues while retransmits keep coming within 2*gap + slack;
// a longer silence means the connection made progress. Mirrored in abi.py.
#define STREAK_SLACK_NS 1000000000ULL
#define STREAK_DEFAULT_GAP_NS 1000000000ULL

struct exec_event {
    u32 kind;
    u32 pid;
    u32 tid;
    u32 ppid;
    u32 uid;
    u32 gid;
    u32 slot;
    u16 argc;
    u16 args_len;
    u64 ts_ns;
    u32 flags;
    u32 _pad;
    char filename[FNAME_LEN];
    char args[ARGS_BUF + ARG_LEN];
};

struct conn_event {
    u32 kind;
    u32 slot;
    u64 ts_ns;
    u64 skaddr;
    u64 duration_ns;
    u32 pid;
    u32 retrans;
    u16 family;
    u16 sport;
    u16 dport;
    u8 oldstate;
    u8 newstate;
    u8 saddr[16];
    u8 daddr[16];
};

struct sock_info {
    u64 start_ns;
    u64 est_ns;
    u64 streak_ns;
    u64 last_retrans_ns;
    u64 gap_ns;
    u32 slot;
    u32 pid;
    u32 retrans;
    u32 state;
};

struct slot_stats {
    u64 retrans;
    u64 resets_rx;
    u64 resets_tx;
    u64 connects;
    u64 connect_failures;
    u64 execs;
};

struct ep_key {
    u8 addr[16];
    u16 port;
    u16 family;
};

struct ep_stats {
    u64 retrans;
    u64 resets;
    u64 connect_failures;
    u64 last_retrans_ns;
};

BPF_PERF_OUTPUT(events);
BPF_PERF_OUTPUT(node_events);
BPF_PERCPU_ARRAY(exec_scratch, struct exec_event, 1);
BPF_TABLE("lru_hash", u32, struct exec_event, exec_stash, 1024);
BPF_TABLE("lru_hash", u32, u32, parent, 16384);
BPF_HASH(tracked, u32, u32, MAX_TRACKED);
BPF_HASH(spawner, u32, u32, 64);
BPF_HASH(socks, u64, struct sock_info, MAX_SOCKS);
BPF_ARRAY(slot_stats, struct slot_stats, MAX_SLOTS);
BPF_HASH(endpoints, struct ep_key, u32, MAX_EPS * 2);
BPF_ARRAY(ep_stats, struct ep_stats, MAX_EPS);

static __always_inline struct slot_stats *stats_for(u32 slot) {
    if (slot == 0 || slot >= MAX_SLOTS)
        return 0;
    return slot_stats.lookup(&slot);
}

static __always_inline struct ep_stats *ep_for(u16 family, const u8 *a4, const u8 *a6, u16 port) {
    struct ep_key k = {};
    k.port = port;
    k.family = family;
    if (family == AF_INET_)
        __builtin_memcpy(k.addr, a4, 4);
    else if (family == AF_INET6_)
        __builtin_memcpy(k.addr, a6, 16);
    else
        return 0;
    u32 *id = endpoints.lookup(&k);
    if (!id)
        return 0;
    u32 i = *id;
    return ep_stats.lookup(&i);
}

// ------------------------------------------------------------------------- processes

TRACEPOINT_PROBE(sched, sched_process_fork) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    u32 child = args->child_pid;
    u32 *s = tracked.lookup(&tgid);
    if (!s)
        s = spawner.lookup(&tid);
    if (s) {
        u32 slot = *s;
        tracked.update(&child, &slot);
    }
#if NODE_ACTIVITY
    parent.update(&child, &tgid);
#else
    if (s)
        parent.update(&child, &tgid);
#endif
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (tid != tgid) {
        // a thread: fork inserted an entry under its tid; the process entry stays
        tracked.delete(&tid);
        parent.delete(&tid);
    }
#ifdef HAVE_EXIT_GROUP_DEAD
    if (args->group_dead) {
#else
    if (tid == tgid) {
#endif
        tracked.delete(&tgid);
        parent.delete(&tgid);
    }
    return 0;
}

// argv is read at syscall entry, while the old image's memory is still there, into a
// stash keyed by thread id; sched_process_exec (only on success) completes and emits it.
TRACEPOINT_PROBE(syscalls, sys_enter_execve) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
#if !NODE_ACTIVITY
    if (!tracked.lookup(&tgid))
        return 0;
#endif
    u32 zero = 0;
    struct exec_event *e = exec_scratch.lookup(&zero);
    if (!e)
        return 0;
    e->argc = 0;
    e->flags = 0;
    u32 off = 0;
    const char *const *argv = (const char *const *)args->argv;
#pragma unroll
    for (int i = 0; i < MAX_ARGS; i++) {
        const char *p = 0;
        bpf_probe_read_user(&p, sizeof(p), &argv[i]);
        if (!p)
            goto done;
        if (off > ARGS_BUF - ARG_LEN) {
            e->flags |= EXEC_ARGV_TRUNCATED;
            goto done;
        }
        int n = bpf_probe_read_user_str(&e->args[off & (ARGS_BUF - 1)], ARG_LEN, p);
        if (n <= 0)
            goto done;
        if (n == ARG_LEN)
            e->flags |= EXEC_ARGV_TRUNCATED;
        off += n;
        e->argc++;
    }
    {
        const char *p = 0;
        bpf_probe_read_user(&p, sizeof(p), &argv[MAX_ARGS]);
        if (p)
            e->flags |= EXEC_ARGV_TRUNCATED;
    }
done:
    e->args_len = off;
    exec_stash.update(&tid, e);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exec) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 old = args->old_pid;
    u32 *s = tracked.lookup(&tgid);
    u32 slot = s ? *s : 0;
    if (slot) {
        struct slot_stats *st = stats_for(slot);
        if (st)
            __sync_fetch_and_add(&st->execs, 1);
    }
#if !NODE_ACTIVITY
    if (!slot) {
        exec_stash.delete(&old);
        return 0;
    }
#endif
    struct exec_event *e = exec_stash.lookup(&old);
    if (!e) {
        u32 zero = 0;
        e = exec_scratch.lookup(&zero);
        if (!e)
            return 0;
        e->argc = 0;
        e->args_len = 0;
        e->flags = EXEC_ARGV_MISSING;
    }
    e->kind = EV_EXEC;
    e->pid = tgid;
    e->tid = old;
    e->slot = slot;
    e->ts_ns = bpf_ktime_get_ns();
    u64 ug = bpf_get_current_uid_gid();
    e->uid = (u32)ug;
    e->gid = ug >> 32;
    u32 *pp = parent.lookup(&tgid);
    e->ppid = pp ? *pp : 0;
    TP_DATA_LOC_READ_STR(e->filename, filename, FNAME_LEN);
    u32 size = offsetof(struct exec_event, args) + e->args_len;
    if (size > sizeof(struct exec_event))
        size = sizeof(struct exec_event);
    if (slot)
        events.perf_submit(args, e, size);
    else
        node_events.perf_submit(args, e, size);
    exec_stash.delete(&old);
    return 0;
}

// ------------------------------------------------------------------------------ tcp

static __always_inline void emit_conn(void *ctx, struct sock_info *si, u64 sk, u64 now, u64 since,
                                      int oldstate, int newstate, u16 family, u16 sport, u16 dport,
                                      const u8 *s4, const u8 *d4, const u8 *s6, const u8 *d6) {
    struct conn_event ev = {};
    ev.kind = EV_CONN;
    ev.slot = si->slot;
    ev.ts_ns = now;
    ev.skaddr = sk;
    ev.duration_ns = since ? now - since : 0;
    ev.pid = si->pid;
    ev.retrans = si->retrans;
    ev.family = family;
    ev.sport = sport;
    ev.dport = dport;
    ev.oldstate = oldstate;
    ev.newstate = newstate;
    if (family == AF_INET_) {
        __builtin_memcpy(ev.saddr, s4, 4);
        __builtin_memcpy(ev.daddr, d4, 4);
    } else {
        __builtin_memcpy(ev.saddr, s6, 16);
        __builtin_memcpy(ev.daddr, d6, 16);
    }
    events.perf_submit(ctx, &ev, sizeof(ev));
}

TRACEPOINT_PROBE(sock, inet_sock_set_state) {
    if (args->protocol != IPPROTO_TCP_)
        return 0;
    u64 sk = (u64)args->skaddr;
    int os = args->oldstate, ns = args->newstate;
    u64 now = bpf_ktime_get_ns();

    if (os == TCP_SYN_SENT_ && ns == TCP_CLOSE_) {
        struct ep_stats *ep = ep_for(args->family, args->daddr, args->daddr_v6, args->dport);
        if (ep)
            __sync_fetch_and_add(&ep->connect_failures, 1);
    }

    if (ns == TCP_SYN_SENT_) {
        // connect(): process context, "current" is the caller
        u32 tgid = bpf_get_current_pid_tgid() >> 32;
        u32 *s = tracked.lookup(&tgid);
        if (!s)
            return 0;
        struct sock_info si = {};
        si.start_ns = now;
        si.slot = *s;
        si.pid = tgid;
        si.state = ns;
        socks.update(&sk, &si);
        struct slot_stats *st = stats_for(si.slot);
        if (st)
            __sync_fetch_and_add(&st->connects, 1);
        emit_conn(args, &si, sk, now, 0, os, ns, args->family, args->sport, args->dport,
                  args->saddr, args->daddr, args->saddr_v6, args->daddr_v6);
        return 0;
    }

    struct sock_info *si = socks.lookup(&sk);
    if (!si)
        return 0;
    si->state = ns;
    if (os == TCP_SYN_SENT_ && ns == TCP_ESTABLISHED_) {
        si->est_ns = now;
        si->streak_ns = 0;
        si->last_retrans_ns = 0;
        si->gap_ns = 0;
        emit_conn(args, si, sk, now, si->start_ns, os, ns, args->family, args->sport, args->dport,
                  args->saddr, args->daddr, args->saddr_v6, args->daddr_v6);
    } else if (ns == TCP_CLOSE_) {
        if (os == TCP_SYN_SENT_) {
            struct slot_stats *st = stats_for(si->slot);
            if (st)
                __sync_fetch_and_add(&st->connect_failures, 1);
        }
        emit_conn(args, si, sk, now, si->start_ns, os, ns, args->family, args->sport, args->dport,
                  args->saddr, args->daddr, args->saddr_v6, args->daddr_v6);
        socks.delete(&sk);
    }
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb) {
    u64 sk = (u64)args->skaddr;
    u64 now = bpf_ktime_get_ns();
    struct sock_info *si = socks.lookup(&sk);
    if (si) {
        struct slot_stats *st = stats_for(si->slot);
        if (st)
            __sync_fetch_and_add(&st->retrans, 1);
        u64 gap = si->gap_ns;
        if (!gap)
            gap = si->state == TCP_SYN_SENT_ ? now - si->start_ns : STREAK_DEFAULT_GAP_NS;
        if (!si->last_retrans_ns || now - si->last_retrans_ns > 2 * gap + STREAK_SLACK_NS) {
            si->streak_ns = now;
            si->gap_ns = si->state == TCP_SYN_SENT_ ? now - si->start_ns : 0;
        } else {
            si->gap_ns = now - si->last_retrans_ns;
        }
        si->last_retrans_ns = now;
        si->retrans++;
    }
    struct ep_stats *ep = ep_for(args->family, args->daddr, args->daddr_v6, args->dport);
    if (ep) {
        __sync_fetch_and_add(&ep->retrans, 1);
        ep->last_retrans_ns = now;
    }
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_receive_reset) {
    u64 sk = (u64)args->skaddr;
    struct sock_info *si = socks.lookup(&sk);
    if (si) {
        struct slot_stats *st = stats_for(si->slot);
        if (st)
            __sync_fetch_and_add(&st->resets_rx, 1);
    }
#ifdef HAVE_RR_ADDR
    struct ep_stats *ep = ep_for(args->family, args->daddr, args->daddr_v6, args->dport);
    if (ep)
        __sync_fetch_and_add(&ep->resets, 1);
#endif
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_send_reset) {
    u64 sk = (u64)args->skaddr;
    if (!sk)
        return 0;
    struct sock_info *si = socks.lookup(&sk);
    if (si) {
        struct slot_stats *st = stats_for(si->slot);
        if (st)
            __sync_fetch_and_add(&st->resets_tx, 1);
    }
    return 0;
}
