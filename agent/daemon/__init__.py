"""The composition root ("the hall"): the one place that knows every part.

Modules: core (the Daemon: the event loop's life, the session and shard callbacks, the
self-fence, the graceful drain, the status document, the coordination watches, ``millwright
run``), ground (Ground: the values the Daemon builds and the wiring hands to parts one by
one), hooks (Hooks: the lists the Daemon calls parts through, filled by the wiring; Wired:
what the wiring returns), wiring (which parts a daemon runs, in start order, and how they
are passed to each other), admin (the root-only status socket and ``millwright status``).

May import: every other package of ``agent`` but ``demo``. Only ``cli`` and ``demo`` import
it (scripts/check-imports.py checks both rules). No part receives the Daemon or the Ground:
each part's constructor takes the single values it uses.
"""
