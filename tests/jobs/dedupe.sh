#!/bin/sh
# Test job that dedupes its own side effect on MILLWRIGHT_FIRE_ID (what a job with
# retry.on owner_lost should do). $1: output dir, $2: seconds of work before the effect.
# Every execution is logged; the effect is one file per firing, created atomically with
# noclobber, so a retry of a firing whose earlier attempt already made it does nothing.
echo "$MILLWRIGHT_JOB_ID $MILLWRIGHT_FIRE_ID $MILLWRIGHT_ATTEMPT $MILLWRIGHT_RUN_ID $$" >> "$1/executions"
[ -n "$2" ] && [ "$2" != 0 ] && sleep "$2"
set -C
{ echo "$MILLWRIGHT_RUN_ID" > "$1/effects/$MILLWRIGHT_JOB_ID.$MILLWRIGHT_FIRE_ID"; } 2>/dev/null
exit 0
