#!/bin/sh
# Millwright demo job: collect diagnostics of a production line.
#   $1 side-effect directory  $2 line
# Its template allows only the demo's job scripts, sh and sleep; it also runs uname,
# which is outside allow_exec: an exec-policy violation (bpf.mode enforce kills the run).
uid=
while read -r key value _; do [ "$key" = "Uid:" ] && uid=$value; done < /proc/$$/status
echo "$MILLWRIGHT_JOB_ID $MILLWRIGHT_FIRE_ID $MILLWRIGHT_ATTEMPT $$ $uid" >> "$1/effects.log"
echo "line $2 diagnostics"
uname -a
sleep 2
echo "line $2 diagnostics done"
