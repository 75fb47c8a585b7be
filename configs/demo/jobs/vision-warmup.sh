#!/bin/sh
# Millwright demo job: load a camera's vision model into memory.
#   $1 side-effect directory  $2 MiB the model needs
# The job's memory limit is far smaller than the model: the kernel OOM-kills it inside
# its cgroup (with the rlimit backend the allocation fails instead).
uid=
while read -r key value _; do [ "$key" = "Uid:" ] && uid=$value; done < /proc/$$/status
echo "$MILLWRIGHT_JOB_ID $MILLWRIGHT_FIRE_ID $MILLWRIGHT_ATTEMPT $$ $uid" >> "$1/effects.log"
echo "loading a $2 MiB model"
exec /usr/bin/python3 -c 'import sys, time; blob = b"\x01" * (int(sys.argv[1]) << 20); time.sleep(2); print("model loaded")' "$2"
