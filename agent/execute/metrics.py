"""Prometheus collectors of the execute package (declared once, shared REGISTRY)."""

from __future__ import annotations

from agent.runtime.metrics import counter, gauge, histogram

QUOTA_KILLS = counter("millwright_quota_kills_total",
                      "Runs ended because they hit a quota (oom, pids_limit).", ("reason",))
RUNS_FINISHED = counter("millwright_runs_finished_total", "Runs that ended, by reason.", ("reason",))
RUN_CPU = counter("millwright_run_cpu_seconds_total", "CPU seconds used by finished runs.")
RUN_THROTTLED = counter("millwright_run_cpu_throttled_seconds_total",
                        "Time finished runs spent throttled by their cpu quota.")
RUN_OOM_KILLS = counter("millwright_run_oom_kills_total", "Kernel OOM kills inside runs.")
RUN_PEAK_MEM = histogram("millwright_run_memory_peak_bytes", "Peak memory of finished runs.",
                         buckets=tuple(2 ** i * 1024 * 1024 for i in range(0, 13)))
RUNS_RUNNING = gauge("millwright_runs_running", "Runs whose processes are alive.")
RUNS_WAITING = gauge("millwright_runs_waiting", "Runs waiting for node budget (reason quota).")
ADMISSION_SECONDS = histogram("millwright_admission_decision_seconds",
                              "Time to decide whether a run fits the node budget.",
                              buckets=(1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2))
ADMISSION_DECISIONS = counter("millwright_admission_decisions_total",
                              "Admission decisions.", ("decision",))
SPAWN_SECONDS = histogram("millwright_spawn_seconds", "Executor.start() duration (fork to exec).",
                          ("backend",), buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0))
SPAWN_ERRORS = counter("millwright_spawn_errors_total", "Runs that could not be started.", ("stage",))
CGROUP_CLEANUP_FAILURES = counter("millwright_cgroup_cleanup_failures_total",
                                  "Run cgroups that could not be removed at once (retried later).")
OUTPUT_TRUNCATED = counter("millwright_run_output_truncated_bytes_total",
                           "stdout/stderr bytes dropped beyond output_max_bytes.")
BACKEND_INFO = gauge("millwright_quota_backend_info", "Active quota backend (value 1).", ("backend",))
CLEANUP_TREES = counter("millwright_cleanup_trees_total",
                        "Discarded directory trees (runs' work dirs, old run dirs) by outcome: removed, "
                        "quarantined, stuck (quarantine full), not_moved (could not enter the trash).", ("event",))
CLEANUP_ENTRIES = counter("millwright_cleanup_entries_removed_total",
                          "Files and directories the cleaner removed.")
CLEANUP_PENDING = gauge("millwright_cleanup_pending_trees", "Trees in the cleaner's trash, not removed yet.")
CLEANUP_SECONDS = histogram("millwright_cleanup_tree_seconds", "From a tree's discard to its removal or set-aside.",
                            buckets=(0.001, 0.01, 0.1, 1.0, 10.0, 60.0, 600.0))
