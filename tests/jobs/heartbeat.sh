#!/bin/sh
# Test job with its own clock: logs "start", then it and a child (both ignoring SIGTERM)
# log "hb" lines with the wall time every 0.1 s for $2 seconds, then "end". The last
# "hb" of an attempt bounds when its processes died. $1: log file.
log="$1"
trap '' TERM
echo "start $MILLWRIGHT_FIRE_ID $MILLWRIGHT_ATTEMPT $(date +%s.%N) $$" >> "$log"
( trap '' TERM; while :; do echo "hb $MILLWRIGHT_ATTEMPT $(date +%s.%N) $$ child" >> "$log"; sleep 0.1; done ) &
end=$(( $(date +%s) + $2 ))
while [ "$(date +%s)" -lt "$end" ]; do
  echo "hb $MILLWRIGHT_ATTEMPT $(date +%s.%N) $$ main" >> "$log"
  sleep 0.1
done
kill -9 $! 2>/dev/null
echo "end $MILLWRIGHT_FIRE_ID $MILLWRIGHT_ATTEMPT $(date +%s.%N)" >> "$log"
