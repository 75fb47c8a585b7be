#!/bin/sh
# Test job: appends one line per execution to the file named by $1, then sleeps $2 s and
# exits with $3. The line is the side effect the exactly-once tests count.
echo "$MILLWRIGHT_JOB_ID $MILLWRIGHT_FIRE_ID $MILLWRIGHT_ATTEMPT $$" >> "$1"
[ -n "$2" ] && [ "$2" != 0 ] && sleep "$2"
exit "${3:-0}"
