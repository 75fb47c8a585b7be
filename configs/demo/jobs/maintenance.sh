#!/bin/sh
# Millwright demo job: a routine maintenance task (oil check, coolant flush, filter swap,
# vibration sample, press calibration).
#   $1 side-effect directory  $2 task  $3 line or press  $4 seconds the task takes
# Side effect counted by the demo to prove exactly-once: one line per execution,
# "<job id> <fire id> <attempt> <pid> <uid>", appended to $1/effects.log.
uid=
while read -r key value _; do [ "$key" = "Uid:" ] && uid=$value; done < /proc/$$/status
echo "$MILLWRIGHT_JOB_ID $MILLWRIGHT_FIRE_ID $MILLWRIGHT_ATTEMPT $$ $uid" >> "$1/effects.log"
echo "$2 $3: started (attempt $MILLWRIGHT_ATTEMPT)"
if [ "${4:-0}" != 0 ]; then sleep "$4"; fi
echo "$2 $3: done"
