"""Supervision: kernel signals turned into job health and lease decisions, and applied.

Modules: sensing (runs -> sensor slots, events -> per-run signals), health (per-run
health and the exec allow-list), leasepolicy (keepalive, early fence, hand-off),
component (the daemon component that applies decisions to runs and shards).

May import: ``signals``, ``config``, ``runtime`` leaves. Reaches the scheduler only
through the RunGate it is given and is told of runs as a RunListener; all of it is
wired by agent/daemon/wiring.py.
"""
