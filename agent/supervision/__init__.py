"""Supervision: kernel signals turned into job health and lease decisions, and applied.

Modules: sensing (runs -> sensor slots, events -> per-run signals), health (per-run
health and the exec allow-list), leasepolicy (keepalive, early fence, hand-off),
component (the daemon component that applies decisions to runs and shards).

May import: ``signals``, ``config``, ``runtime.loop``/``metrics``. Reaches the
scheduler and the daemon only through the seams the daemon passes in.
"""
