#!/bin/sh
# Fault-test job: records its side effect as a "start" line (job, firing, attempt, the
# agent that ran it, pid, epoch time) in the file named by $1, sleeps $3 s, writes an
# "end" line and exits 3 while its attempt is below $4 (a retrying job), else 0.
# tests/support/history.py parse_effects reads the lines; lateness is measured on this
# clock, the host's: a job's environment is clean, so an agent's clock shim (a clock fault
# of tests/support/chaos.py) never reaches it.
out=$1 agent=$2
echo "start $MILLWRIGHT_JOB_ID $MILLWRIGHT_FIRE_ID $MILLWRIGHT_ATTEMPT $agent $$ $(date +%s.%N)" >> "$out"
[ -n "$3" ] && [ "$3" != 0 ] && sleep "$3"
echo "end $MILLWRIGHT_JOB_ID $MILLWRIGHT_FIRE_ID $MILLWRIGHT_ATTEMPT $agent $$ $(date +%s.%N)" >> "$out"
[ "$MILLWRIGHT_ATTEMPT" -lt "${4:-0}" ] && exit 3
exit 0
