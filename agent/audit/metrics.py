"""Prometheus collectors of the audit writer (declared once, shared REGISTRY)."""

from __future__ import annotations

from agent.runtime.metrics import counter, gauge, histogram

RECORDS = counter("millwright_audit_records_total", "Audit records written, by record type.", ("type",))
DROPPED = counter("millwright_audit_dropped_records_total",
                  "Audit records lost (queue full or write error); each loss also becomes a gap record.", ("reason",))
GAPS = counter("millwright_audit_gaps_total", "Gap records written (each stands for one or more lost records).")
QUEUE_DEPTH = gauge("millwright_audit_queue_depth", "Records waiting for the audit writer thread.")
WRITE_ERRORS = counter("millwright_audit_write_errors_total", "Failed writes or fsyncs of audit files.")
FSYNC_SECONDS = histogram("millwright_audit_fsync_seconds", "Duration of audit file fsyncs.",
                          buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
WRITTEN_BYTES = counter("millwright_audit_written_bytes_total", "Bytes appended to audit files.")
ROTATIONS = counter("millwright_audit_rotations_total", "Audit file rotations.")
RECOVERIES = counter("millwright_audit_recoveries_total", "Writer starts after an unclean stop (recovered records).")
CHECKPOINTS_TOTAL = counter("millwright_audit_checkpoints_total", "Checkpoint records written, by kind.", ("kind",))
