"""The agent's ground floor: the one event loop that owns all state, and the helpers
every part may use.

Modules: loop (timer heap and event queue), seams (the Component, ShardListener and
SessionListener Protocols the daemon calls parts through), metrics (Prometheus helpers),
logs (log set-up), gcpolicy (garbage-collection timing around due times), timefmt (the
RFC 3339 parser and formatter), text (quoting input in error messages), recent (bounded
memories of recently seen keys), kernel (the Linux system calls and capability names the
os module lacks: namespaces, mounts, capabilities, Landlock).

The daemon that wires every part together is agent/daemon. ``loop``, ``metrics``,
``logs``, ``timefmt``, ``text``, ``recent`` and ``kernel`` are leaves that anything may
import (scripts/check-imports.py checks these rules).
"""
