"""The armed launcher: the shell script that releases a run prepared for a due time.

The kernel, not the agent, releases the job. The agent writes "a" on the go pipe once the
launcher is confined (cgroup, rlimits, run guard, poststart hooks); the launcher then
waits on that pipe with a timeout ending at its due time ($1, wall clock in
microseconds; the shell's read -t is a (p)select, woken by the kernel's timer: no agent
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
# counts, so a launcher whose release thread's "g" and close meet its timer execs the job
# rather than exiting 126. bash because dash has neither a read timeout nor a
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
umask 077
unset PWD OLDPWD SHLVL
declare -a SHLVL
exec "$@"
"""
BASH = ("/bin/bash", BASH_SCRIPT)

# The same protocol in mksh's legacy flavour, lksh (Debian package mksh): statically
# linked on Debian (klibc: no dynamic loader), the launcher's exec and wait and the job's
# exec of /bin/true cost 0.9-1.0 ms of CPU, with bash 2.4-3.3 (/bin/true alone 0.5-0.6).
# Its arithmetic is C long, 32-bit on 32-bit arches as mksh's
# always is: the due time is split into seconds and microseconds, no number needs more.
# mksh's read -t compares its deadline with the clock before each select and gives up on
# one already past without looking at the pipe ("read -t 0" is no poll), and drops the
# bytes of a line it was reading when the deadline passes between two of them. So the wait
# reads "g\n" with one read(2) (-N 2; the agent writes it in one write), and a launcher
# that gets its "a" less than 0.1 ms before its due time (or after it) waits up to 50 ms
# for the agent's word, where bash polls: it looks at the pipe only if the shell is not
# descheduled for longer than its timeout between its two clock reads, and a late
# launcher's "g" comes from the agent's armed release 5 ms after the due time (at once
# when the arming itself was late). The select looks at the pipe once more
# when its timer fires: an EOF already there is seen as EOF (exit 126). Its status is 142
# on a timeout, 1 on EOF, 2 when a signal the shell catches interrupts it (SIGCHLD,
# SIGWINCH, SIGALRM; nothing sends them to a launcher): exit 126, where bash would keep
# waiting. mksh exports "_" (the command's path) with every exec, even exec -c; made a
# name reference to an array element, it takes the assignment, and an array's elements
# other than the first are never exported. The variables are a function's locals, as in
# BASH_SCRIPT.
KSH_SCRIPT = """function w {
  typeset m n s u t
  read -r m || exit 126
  [ "$m" = a ] || return 0
  n=$EPOCHREALTIME
  s=${1%??????}
  u=$(( 10#${1#"$s"} - 10#${n#*.} ))
  s=$(( s - ${n%.*} ))
  if (( u < 0 )); then u=$(( u + 1000000 )); s=$(( s - 1 )); fi
  t=0.05
  if (( s > 0 || (s == 0 && u >= 100) )); then typeset -Z6 u; t=$s.$u; fi
  read -r -N 2 -t $t m || (( $? > 128 )) || exit 126
}
w "$1"
shift
exec </dev/null
umask 077
unset PWD OLDPWD SHLVL
typeset -n _=nx[1]
exec "$@"
"""
LKSH = ("/bin/lksh", KSH_SCRIPT)

# The launcher shells in order of preference, each with its script: bash is Essential on
# Debian, so every shim-mode agent can arm; mksh is a Recommends of the package.
CANDIDATES: tuple[tuple[str, str], ...] = (LKSH, BASH)


def pick_launcher() -> Optional[tuple[str, str]]:
    """(shell, script) of the first installed candidate, or None: no run is armed then."""
    for shell, script in CANDIDATES:
        if os.access(shell, os.X_OK):
            return shell, script
    return None
