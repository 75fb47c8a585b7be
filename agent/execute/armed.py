"""The armed launcher: the shell script that releases a run prepared for a due time.

The kernel, not the agent, releases the job. The agent writes "a" on the go pipe once the
launcher is confined (cgroup, rlimits, run guard, poststart hooks); the launcher then
waits on that pipe with a timeout ending at its due time ($1, wall clock in
microseconds; the shell's read -t is a pselect, woken by the kernel's timer: no agent
thread, no GIL at the due time) and execs the job directly, its user switch (setpriv)
done before it waited. A "g" releases it early; EOF (the agent discarded the run, or
died) ends it without exec, also when the EOF is already there as its due time comes.
The job's argv are positional parameters: never parsed by the shell, and its
environment is exactly the clean one the agent passed. Nothing in a script forks.
"""

from __future__ import annotations

import os
from typing import Optional

# A read that times out keeps what it read (bash): a "g" that arrived with the timeout
# counts (without that check 1 in ~1,500 launchers exited 126 when the release thread's
# "g" and close met the timer). bash because dash has neither a read timeout nor a
# clock; printf -v and $(( )) are builtins. bash exports SHLVL on exec, except an array,
# and the script's variables are a function's locals (a template env naming one is
# exported: it would reach the job changed): the job's environment stays exactly the
# clean one.
BASH_SCRIPT = """w() {
  local m d t r
  read -r m || exit 126
  if [ "$m" = a ]; then
    d=$(( $1 - ${EPOCHREALTIME/./} ))
    if (( d > 0 )); then
      printf -v t '%d.%06d' $((d / 1000000)) $((d % 1000000))
      m=
      read -r -t "$t" m
      r=$?
      if (( r > 128 )); then
        if [ "$m" != g ] && read -r -t 0; then read -r m || exit 126; fi
      elif (( r != 0 )); then exit 126
      fi
    elif read -r -t 0; then read -r m || exit 126
    fi
  fi
}
w "$1"
shift
exec </dev/null
unset PWD OLDPWD SHLVL
declare -a SHLVL
exec "$@"
"""
BASH = ("/bin/bash", BASH_SCRIPT)

# The launcher shells in order of preference, each with its script.
CANDIDATES: tuple[tuple[str, str], ...] = (BASH,)


def pick_launcher() -> Optional[tuple[str, str]]:
    """(shell, script) of the first installed candidate, or None: no run is armed then."""
    for shell, script in CANDIDATES:
        if os.access(shell, os.X_OK):
            return shell, script
    return None
