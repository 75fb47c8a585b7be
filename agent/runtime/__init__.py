"""The agent's runtime: the one event loop that owns all state, and its wiring.

Modules: loop (timer heap and event queue), daemon (the Agent: session, shards, the
loop's life and graceful stop), components (which parts a daemon runs, in order),
admin (root-only status socket), metrics (Prometheus helpers), logs (log set-up),
gcpolicy (garbage-collection timing around due times).

May import: every other package of ``agent`` (it is the only place that knows all
parts). Nothing outside ``runtime`` imports ``daemon`` or ``components``; ``loop``,
``metrics`` and ``logs`` are leaves that anything may import.
"""
