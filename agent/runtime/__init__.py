"""The agent's runtime: the one event loop that owns all state, and its wiring.

Modules: loop (timer heap and event queue), daemon (the Agent: session, shards, the
loop's life and graceful stop; the Component, ShardListener and SessionListener seams),
components (which parts a daemon runs, in order, and how they are passed to each
other), admin (root-only status socket), metrics (Prometheus helpers), logs (log
set-up), gcpolicy (garbage-collection timing around due times), timefmt (the RFC 3339
parser and formatter), text (quoting input in error messages), recent (bounded memories
of recently seen keys), kernel (the Linux system calls and capability names the os module
lacks: namespaces, mounts, capabilities, Landlock).

May import: every other package of ``agent`` (it is the only place that knows all
parts). Nothing outside ``runtime`` imports ``daemon`` or ``components`` at run time
(type annotations may name the Agent); ``loop``, ``metrics``, ``logs``, ``timefmt``,
``text``, ``recent`` and ``kernel`` are leaves that anything may import (scripts/check-imports.py
checks these rules).
"""
