"""The jobs package's metrics, declared once (agent/runtime/metrics.py)."""

from agent.runtime.metrics import counter, gauge, histogram

RUNS = counter("millwright_runs_total", "Finished runs by result", ("result",))
FIRINGS = counter("millwright_firings_total", "Firings by outcome", ("outcome",))
ABANDONED = counter("millwright_firings_abandoned_total",
                    "Firings this agent gave up without a record of its own, by why", ("why",))
TRIGGER_DELAY = histogram("millwright_trigger_delay_seconds", "Process start minus due time",
                          buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))
JOB_DURATION = histogram("millwright_job_duration_seconds", "Run duration",
                         buckets=(0.01, 0.1, 0.5, 1, 5, 15, 60, 300, 1800, 7200))
JOBS_OWNED = gauge("millwright_jobs_owned", "Jobs in shards this agent holds")
REJECTED_STORED = counter("millwright_jobs_rejected_stored_total",
                          "Stored jobs refused at load (signature, binding, retired key, invalid)", ("reason",))
CLAIMS = counter("millwright_claims_total", "Claims of a firing's run record by outcome", ("outcome",))
FOREIGN_RECORDS = counter("millwright_foreign_records_total",
                          "Run records this agent did not write and does not believe, by where found", ("where",))
ROLLOUT_DECISIONS = counter("millwright_rollout_decisions_total",
                            "Staged-rollout decisions by kind (start, wait, aborted, abort, stop, rollback, conflict)",
                            ("decision",))
APPROVAL_DECISIONS = counter("millwright_approval_decisions_total",
                             "Four-eyes decisions on firings by kind (approved, waiting, expired)", ("decision",))
# the plant's rules: windows, gates, progress (docs/jobs.md)
PROGRESS_LINES = counter("millwright_progress_lines_total", "Valid progress lines runs reported")
WAITING = gauge("millwright_firings_waiting", "Firings waiting on a start policy, by policy (window, gate)",
                ("policy",))
GATE_OPEN = gauge("millwright_gate_open", "1 while a production gate is open, 0 closed, -1 unknown", ("gate",))
GATE_CHANGES = counter("millwright_gate_changes_total", "Production gate changes seen, by gate and new state",
                       ("gate", "state"))
POLICY_DECISIONS = counter("millwright_start_policy_decisions_total",
                           "What the start policies decided for a firing, by policy and decision",
                           ("policy", "decision"))
