"""Millwright: an edge agent for factory maintenance jobs."""

import os

__version__ = "0.1.0"
CONTRACT_VERSION = 1

# gRPC's fork handlers off, before any module of ours can start gRPC (it reads this once).
# With them on (the default of its C core), every fork() of a process that has used gRPC
# first waits for gRPC's threads to stop, and one that waits for the GIL the forking thread
# holds never stops: a subprocess with preexec_fn, or the fork spawn mode, hangs for good.
# Every fork here execs at once and no child uses gRPC, so nothing needs them. This does not
# reach the event engine's own fork handlers (python3-grpcio 1.51 registers them whatever the
# setting), so the agent and its test services start processes without fork(): posix_spawn
# or subprocess's vfork path (agent/demo/childproc.py).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
