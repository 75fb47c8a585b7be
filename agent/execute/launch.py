"""Spawning a run's process: the launcher (a constant shell script started with
posix_spawn, agent/execute/pspawn.py, or subprocess's vfork path; or a forked child),
user switch, clean environment, run dir, quota container, poststart hooks, and the go
pipe that lets the job exec.

Because the launcher waits for the go byte before exec, nothing the job does happens
before it is in its cgroup, registered with the run guard (agent/execute/guard.py) and
every poststart hook ran: no exec is missed by the sensor.
"""

from __future__ import annotations

import logging
import os
import pwd
import resource
import shutil
import signal
import stat
import subprocess
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from agent.execute import metrics as m
from agent.execute import pspawn, threadcreds
from agent.execute.backends import safe_name
from agent.execute.confine import RUN_FILES_ID, Confinement
from agent.execute.isolation import IsolationError
from agent.execute.output import OutputStream
from agent.execute.processes import kill
from agent.execute.progress import ProgressChannel, make_channel
from agent.execute.runs import STDERR_TAIL_BYTES
from agent.execute.runstate import GoPipe, Run
from agent.runtime import kernel

if TYPE_CHECKING:  # pragma: no cover
    from agent.execute.executor import Executor

log = logging.getLogger(__name__)

# Python 3.12 warns on fork() in a threaded process; our child only makes system calls
# (no locks, no imports, no logging) before exec, which is what makes it safe.
warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks.*", category=DeprecationWarning)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_RESET_SIGNALS = pspawn.RESET_SIGNALS
# The launcher of the default ("shim") spawn mode. Forking a large Python process costs
# tens of milliseconds (page tables, copy-on-write faults); subprocess's vfork path costs
# about one. But a vfork child cannot wait for our go-ahead or switch users, so it execs
# this constant script, which blocks on stdin (the go pipe) while the agent puts it into
# its cgroup, sets its rlimits and runs the poststart hooks, then execs the job (through
# setpriv when a user switch is needed). The job's argv are positional parameters
# ("$@"): never parsed by the shell.
SHIM_SH = "/bin/sh"
SHIM_SCRIPT = 'read -r _ || exit 126\nexec </dev/null\nunset PWD OLDPWD\numask 077\nexec "$@"'
JOB_UMASK = 0o077
# A job's limits where the agent's are higher (systemd gives the agent LimitMEMLOCK=infinity
# for BCC, and maybe a large LimitNOFILE): (resource, soft, hard), never raised.
JOB_RLIMITS = ((resource.RLIMIT_MEMLOCK, 8 << 20, 8 << 20), (resource.RLIMIT_NOFILE, 1024, 524288))
_MAXFD = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536


USER_CACHE_S = 10.0
_users: dict[str, tuple[float, Any]] = {}
_users_lock = threading.Lock()


def _lookup_user(name: str) -> Optional[tuple[Any, tuple[int, ...], bool]]:
    """(passwd entry, groups, whether its home is a directory) of a run-as user, or None.
    Cached for USER_CACHE_S: NSS reads /etc/passwd and /etc/group on every call (a quarter
    of a millisecond per spawn on a busy gateway), and the few templates' users hardly
    ever change."""
    now = time.monotonic()
    with _users_lock:
        hit = _users.get(name)
        if hit is not None and now - hit[0] < USER_CACHE_S:
            return hit[1]
    try:
        pw = pwd.getpwnam(name)
        value = (pw, tuple(os.getgrouplist(pw.pw_name, pw.pw_gid)), bool(pw.pw_dir) and os.path.isdir(pw.pw_dir))
    except KeyError:
        value = None
    with _users_lock:
        if len(_users) > 256:
            _users.clear()
        _users[name] = (now, value)
    return value


class SpawnError(Exception):
    def __init__(self, stage: str, message: str):
        super().__init__(message)
        self.stage = stage


# --------------------------------------------------------------------------- child


def _child(go_r: int, err_w: int, out_w: int, errp_w: int, cwd: str, ids: Optional[tuple],
           rlimits: list, path: str, argv: list, env: dict,
           root_caps: Optional[list] = None) -> None:  # pragma: no cover - runs in the child
    """Between fork and exec: system calls only. Never returns. ``root_caps``: a confined
    root run's capabilities (everything else leaves the bounding set; no_new_privs)."""
    stage = "setup"
    try:
        for s in _RESET_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        os.setpgid(0, 0)
        stage = "stdio"
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(errp_w, 2)
        stage = "user"
        if ids is not None:
            uid, gid, groups = ids
            os.setgroups(groups)
            os.setresgid(gid, gid, gid)
            if root_caps is not None:
                for cap in range(kernel.cap_last_cap() + 1):
                    if cap not in root_caps:
                        kernel.prctl(kernel.PR_CAPBSET_DROP, cap)
                kernel.prctl(kernel.PR_SET_NO_NEW_PRIVS, 1)
            os.setresuid(uid, uid, uid)
        os.umask(JOB_UMASK)
        stage = "chdir"
        os.chdir(cwd)
        stage = "rlimit"
        for res, soft, hard in rlimits:
            resource.setrlimit(res, (soft, hard))
        # close every inherited fd before waiting: a copy of a go pipe's or the run guard's
        # writer held here would keep its reader from seeing the agent die
        low = 3
        for keep in sorted({go_r, err_w}):
            os.closerange(low, keep)
            low = keep + 1
        os.closerange(low, _MAXFD)
        stage = "wait"
        if os.read(go_r, 1) != b"g":
            os._exit(126)
        stage = "exec"
        os.execve(path, argv, env)
    except BaseException as exc:  # noqa: BLE001 - nothing may escape into the parent's code
        try:
            os.write(err_w, f"{stage}:{getattr(exc, 'errno', 0) or 0}:{exc}".encode()[:1000])
        except BaseException:  # noqa: BLE001
            pass
    os._exit(127)



# ulimit's option and unit per resource, in the launcher shells (dash, mksh/lksh, bash):
# a launcher that switched users before it waits (the armed one) can no longer be
# prlimit'ed by an agent without CAP_SYS_RESOURCE, so it sets its limits itself
_ULIMIT = {resource.RLIMIT_AS: ("-v", 1024), resource.RLIMIT_CPU: ("-t", 1), resource.RLIMIT_MEMLOCK: ("-l", 1024),
           resource.RLIMIT_NOFILE: ("-n", 1)}
_ULIMIT_NPROC = {"bash": "-u"}   # dash and mksh: -p


def join_lines(n: int) -> str:
    """The launcher script's first lines: it joins its cgroups by writing "0" (itself) to
    the `tasks` files it inherited as fds 3 .. 2+n, then closes them; if any write fails it
    exits without exec'ing anything (the job never runs outside its quota)."""
    if not n:
        return ""
    fds = range(3, 3 + n)
    return ("".join(f"echo 0 >&{fd} || exit 126\n" for fd in fds)
            + "exec " + " ".join(f"{fd}>&-" for fd in fds) + "\n")


def ulimit_lines(shell: str, rlimits: list) -> str:
    """The launcher script's first lines: its limits, soft and hard ((resource, soft, hard);
    both set to ``hard`` where they differ, as ulimit without -H/-S does, then soft)."""
    out = []
    for res, soft, hard in rlimits:
        if res == resource.RLIMIT_NPROC:
            opt, unit = _ULIMIT_NPROC.get(os.path.basename(shell), "-p"), 1
        else:
            opt, unit = _ULIMIT[res]
        out.append(f"ulimit {opt} {max(1, hard // unit)} || exit 126")
        if soft != hard:
            out.append(f"ulimit -S {opt} {max(1, soft // unit)} || exit 126")
    return "".join(line + "\n" for line in out)


def _capped(res: int, val: int) -> tuple[int, int]:
    """A quota's rlimit, at most the agent's own hard limit (only root could raise it)."""
    hard = resource.getrlimit(res)[1]
    return res, val if hard == resource.RLIM_INFINITY else min(val, hard)


def job_rlimits() -> list[tuple[int, int, int]]:
    """(resource, soft, hard) a job gets where the agent's own limits are higher (never
    more than the agent has)."""
    out = []
    for res, soft, hard in JOB_RLIMITS:
        cur_soft, cur_hard = resource.getrlimit(res)
        new_hard = hard if cur_hard == resource.RLIM_INFINITY else min(hard, cur_hard)
        new_soft = min(soft, new_hard) if cur_soft == resource.RLIM_INFINITY else min(soft, new_hard, cur_soft)
        if (new_soft, new_hard) != (cur_soft, cur_hard):
            out.append((res, new_soft, new_hard))
    return out


def _mkdir(path: str, mode: int) -> bool:
    """os.makedirs(exist_ok=True) with one syscall when the parent exists (every run).
    True if this call made it."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return False
    except FileNotFoundError:
        os.makedirs(path, mode=mode, exist_ok=True)
    return True


class Prepared(NamedTuple):
    """prepare_process()'s result: what the launcher is started with."""
    ids: Optional[tuple]   # (uid, gid, groups) to switch to, or None
    path: str              # the job's executable
    env: dict
    cwd: str
    out: str               # stdout.log
    err: str               # stderr.log
    run_dir: str
    confinement: Optional[Confinement] = None   # with an isolating executor (its id is held)
    channel: tuple[str, str] = ("", "")          # its progress FIFO and result file (progress.py)


def prepare_process(ex: "Executor", spec: Any, created: list) -> Prepared:
    """The run's user, executable, environment and directories (made now). ``created``
    receives the work dir the agent provides (removed again at the run's end). With an
    isolating executor the run's confinement is decided here and its id held: the caller
    gives it back (Isolation.release) if the run never starts."""
    if not spec.argv or not all(isinstance(a, str) and "\0" not in a for a in spec.argv):
        raise SpawnError("argv", "argv must be a non-empty list of strings without NUL")
    conf = None
    if ex.isolation is not None and spec.user is not None:
        looked_up = _lookup_user(spec.user)
        if looked_up is None:
            raise SpawnError("user", f"user {spec.user!r} does not exist on this node")
        pw, groups, _ = looked_up
        try:
            conf = ex.isolation.confine(pw.pw_uid, groups, spec.network, spec.allow_root, spec.capabilities)
        except IsolationError as exc:
            raise SpawnError("user", f"cannot run as {spec.user!r}: {exc}") from None
    try:
        return _prepare(ex, spec, created, conf)
    except BaseException:
        if ex.isolation is not None:
            ex.isolation.release(conf)
        raise


def _prepare(ex: "Executor", spec: Any, created: list, conf: Optional[Confinement]) -> Prepared:
    ids = None
    home = None
    name = None
    owner: Optional[tuple[int, int, int]] = None   # of the run's own files: its work dir's
    euid, egid = ex.ids   # the agent's own, read once (each getter is a system call on the loop)
    if conf is not None:
        # its own ids (docs/security.md); its name for USER and LOGNAME, its work dir as HOME
        ids = (conf.uid, conf.gid, conf.groups)
        name = spec.user
    elif spec.user is not None:
        looked_up = _lookup_user(spec.user)
        if looked_up is None:
            raise SpawnError("user", f"user {spec.user!r} does not exist on this node")
        pw, groups, has_home = looked_up
        if euid != 0 and pw.pw_uid != euid:
            raise SpawnError("user", f"cannot run as {spec.user!r}: the agent is not root")
        if (pw.pw_uid, pw.pw_gid) != (euid, egid) or (euid == 0 and frozenset(groups) | {egid} != ex.group_set):
            # a switch (setpriv in shim mode: an exec of ~1.7 ms CPU per run) only when the
            # user or its group differ from the agent's, or, for a root agent (the one that
            # can set them), its supplementary groups: a root agent's root jobs mostly differ
            # only in listing group 0 again
            ids = (pw.pw_uid, pw.pw_gid, list(groups))
        home, name = (pw.pw_dir if has_home else None), pw.pw_name
    else:
        try:
            pw = pwd.getpwuid(euid)
            home, name = pw.pw_dir, pw.pw_name
        except KeyError:
            pass
        if home and not os.path.isdir(home):
            home = None
    env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"}
    path = spec.argv[0]
    if not os.path.isabs(path):
        found = shutil.which(path, path=env["PATH"])
        if not found:
            raise SpawnError("exec", f"{path!r} not found on {env['PATH']}")
        path = found
    run_dir = os.path.join(ex.base_dir, safe_name(spec.run_key))
    if conf is not None:
        assert ex.isolation is not None
        owner = ex.isolation.work_dir_owner(conf)
    try:
        if _mkdir(run_dir, 0o711) and conf is not None:
            # not a root run's to write into (its output files are made there)
            os.chown(run_dir, RUN_FILES_ID, RUN_FILES_ID)
        cwd = spec.cwd
        if cwd is None:
            cwd = os.path.join(run_dir, "work")
            made = _mkdir(cwd, 0o700)
            created.append(cwd)
            if conf is not None and owner is not None:
                os.chown(cwd, owner[0], owner[1])
                if owner[2] != 0o700:
                    os.chmod(cwd, owner[2])
            elif ids is not None and (not made or (ids[0], ids[1]) != (euid, egid)):   # made by us: ours already
                os.chown(cwd, ids[0], ids[1])
        if owner is None and ids is not None:
            owner = (ids[0], ids[1], 0o700)
        if ex.scratch_dir is None:
            channel = make_channel(run_dir, owner)
        else:   # on a tmpfs, named after the run dir
            channel = make_channel(ex.scratch_dir, owner, os.path.basename(run_dir) + ".")
        out = os.path.join(run_dir, "stdout.log")
        err = os.path.join(run_dir, "stderr.log")
    except OSError as exc:
        raise SpawnError("workdir", f"cannot prepare {run_dir}: {exc.strerror}") from None
    if not home:
        home = cwd
    env.update({"HOME": home, "TMPDIR": cwd})
    if name:
        env.update({"USER": name, "LOGNAME": name})
    for k, v in spec.env.items():
        if isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v:
            env[k] = v
    env.update({"MILLWRIGHT_JOB_ID": spec.job_id, "MILLWRIGHT_FIRE_ID": spec.fire_id,
                "MILLWRIGHT_RUN_ID": spec.run_id or spec.run_key, "MILLWRIGHT_ATTEMPT": str(spec.attempt),
                "MILLWRIGHT_PROGRESS": channel[0], "MILLWRIGHT_RESULT": channel[1]})
    return Prepared(ids, path, env, cwd, out, err, run_dir, conf, channel)


class Staged:
    """What a run needs before its launcher starts, made ahead (Executor.stage) on any
    thread: its run and work directories and quota container. A file-system
    or cgroup step may block (a directory on the state disk waits for its journal behind
    etcd's fsyncs), so it is done where a stall delays nothing due (the claim's own etcd
    worker), not on the thread that spawns launchers on time. A failure is kept and
    reported by the spawn, as if it had happened there."""

    __slots__ = ("run_key", "process", "work_dir_created", "slot", "error")

    def __init__(self, run_key: str):
        self.run_key = run_key
        self.process: Optional[Prepared] = None
        self.work_dir_created: Optional[str] = None
        self.slot: Any = None
        self.error: Optional[SpawnError] = None


def stage(ex: "Executor", spec: Any) -> Staged:
    """Directories, the executable check and the quota container of a run (thread-safe:
    only system calls and the user cache). Not the output files: the reaper creates each
    when its first byte comes (OutputStream.open), so a silent run costs the state disk no
    file (each is an inode made now and freed again by retention)."""
    st = Staged(spec.run_key)
    created: list[str] = []
    try:
        st.process = prepare_process(ex, spec, created)
        if ex.spawn_mode == "shim":
            _check_executable(st.process.path)
        st.slot = _take_slot(ex, spec)
    except SpawnError as exc:
        st.error = exc
    except Exception as exc:   # a bug or an unexpected OS error: the run's spawn_error, not the caller's
        log.exception("staging a run failed", extra={"fields": {"run": spec.run_key}})
        st.error = SpawnError("internal", f"internal error: {exc}")
    finally:
        st.work_dir_created = created[0] if created else None
    if st.error is not None and st.process is not None and st.process.confinement is not None:
        assert ex.isolation is not None
        ex.isolation.release(st.process.confinement)   # it will never start: its id goes back now
        st.process = st.process._replace(confinement=None)
    return st


def _check_executable(path: str) -> None:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise SpawnError("exec", f"exec {path}: {exc.strerror}") from None
    if not (stat.S_ISREG(st.st_mode) and st.st_mode & 0o111):
        raise SpawnError("exec", f"exec {path}: not an executable file")


def _take_slot(ex: "Executor", spec: Any) -> Any:
    try:
        return ex.slots.take(spec.limits)
    except OSError as exc:
        raise SpawnError("cgroup", f"cannot create the run's quota container: {exc.strerror or exc}") from None


def spawn(ex: "Executor", run: Run, hold: bool = False, arm_at: Optional[float] = None,
          staged: Optional[Staged] = None) -> None:
    """Start the run's launcher, confine it, then let it exec (or, ``hold``, keep it
    waiting for go()). ``arm_at`` (wall clock; shim mode with an armed launcher only): the
    launcher releases itself then (agent/execute/armed.py); go() before that releases it
    early. ``staged``: its directories, output files and quota container, made ahead by
    stage() (else made here)."""
    spec = run.handle.spec
    if staged is None:
        staged = stage(ex, spec)
    run.work_dir_created = staged.work_dir_created
    run.slot = staged.slot
    if staged.error is not None:
        raise staged.error
    assert staged.process is not None and run.slot is not None
    ids, path, env, cwd, out_path, err_path, run.handle.run_dir, conf, channel = staged.process
    run.confinement = conf   # its id goes back when the run is finalized
    limits = spec.limits
    run.handle.cgroup = dict(run.slot.paths) or None
    rlimits = [(res, val, val) for res, val in (_capped(r, v) for r, v in ex.backend.child_rlimits(limits, spec.timeout_s))]
    rlimits += ex.job_rlimits
    limit = ex.output_max_bytes if spec.output_max_bytes is None else int(spec.output_max_bytes)
    fds: list[int] = []
    try:   # the go pipe, stdout, stderr, and a fork-mode child's exec-error pipe
        for _ in range(3 if ex.spawn_mode == "shim" else 4):
            fds.extend(os.pipe())
        go_r, go_w, out_r, out_w, ep_r, ep_w = fds[:6]
        err_r, err_w = fds[6:] if len(fds) > 6 else (-1, -1)
        run.streams = [OutputStream(out_r, out_path, limit), OutputStream(ep_r, err_path, limit, tail=STDERR_TAIL_BYTES)]
        run.progress = ProgressChannel(channel[0], channel[1], spec.step_timeout_s, scratch=ex.scratch_dir is not None)
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        run.streams, run.progress = [], None   # their fds are closed: the run's end must not close them again
        for entry in channel:   # nothing will open its progress FIFO and result file
            try:
                os.unlink(entry)
            except OSError:
                pass
        raise SpawnError("pipes", f"cannot create pipes: {exc.strerror}") from None
    run.t0 = time.monotonic()   # started_at and t0 are set again at the release (_go)
    slot = run.slot
    if ex.spawn_mode == "shim":
        switch: list[str] = []
        # a confined run's launcher comes from a thread of its own that took the run's ids
        # (agent/execute/threadcreds.py): no setpriv in its chain
        own_ids = conf is not None and ex.thread_switch
        if conf is not None and not own_ids:
            assert ex.setpriv is not None  # shim mode is chosen only when setpriv exists
            switch = conf.setpriv_args(ex.setpriv)
        elif ids is not None and conf is None:
            uid, gid, groups = ids
            assert ex.setpriv is not None  # shim mode is chosen only when setpriv exists
            switch = [ex.setpriv, f"--reuid={uid}", f"--regid={gid}",
                      f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups", "--"]
        # the launcher joins its cgroups by itself, first thing, through the files the slot
        # keeps open (inherited as fds 3, 4, ...): no cgroup move on any thread of the agent
        joining = list(slot.join_fds.items()) if pspawn.available() else []
        inherit = [fd for _, fd in joining]
        slot.joined = {h for h, _ in joining}
        if arm_at is not None:
            # user switch first, then wait: at the due time only the job's own exec is left
            assert ex.armed_launcher is not None  # arm_at is given only when one exists
            shell, script = ex.armed_launcher
            argv = switch + [shell, "-c", join_lines(len(inherit)) + ulimit_lines(shell, rlimits) + script,
                             "millwright-run", str(int(arm_at * 1e6))]
        else:
            argv = [SHIM_SH, "-c", join_lines(len(inherit)) + ulimit_lines(SHIM_SH, rlimits) + SHIM_SCRIPT,
                    "millwright-run"] + switch
        argv += [path] + list(spec.argv[1:])

        def start() -> int:
            workdir: Optional[str] = cwd
            if own_ids:
                assert conf is not None
                # this thread ends after the spawn: it never runs the agent's code again. Its
                # working directory (its own: inside() unshared it) is set while it is still
                # root, as a launcher's was before setpriv, and the launcher inherits it
                os.chdir(cwd)
                workdir = None
                try:
                    threadcreds.become(conf)
                except OSError as exc:
                    raise SpawnError("user", f"cannot take the run's ids: {exc.strerror or exc}") from None
            if pspawn.available():   # one GIL drop per spawn (agent/execute/pspawn.py)
                return pspawn.spawn(argv, env, workdir, go_r, out_w, ep_w, inherit)
            run.popen = subprocess.Popen(argv, stdin=go_r, stdout=out_w, stderr=ep_w, cwd=cwd, env=env,
                                         start_new_session=True, close_fds=True, restore_signals=True)
            return run.popen.pid

        def launch(own_thread: bool) -> int:
            try:   # the spawn in the run's namespaces
                return _inside(ex, conf, start, stay=own_thread)
            except OSError as exc:
                raise SpawnError("exec", f"cannot start the launcher in {cwd}: {exc.strerror or exc}") from None

        try:
            pid = _on_thread(ex, conf, launch, own=own_ids)
        except SpawnError:
            for fd in (go_r, go_w, out_w, ep_w):
                os.close(fd)
            raise
        rlimits = []   # the launcher sets them itself
    else:
        root_caps = conf.capabilities if conf is not None and conf.root else None

        def fork(own_thread: bool) -> int:
            child = os.fork()
            if child == 0:  # pragma: no cover - child
                _child(go_r, err_w, out_w, ep_w, cwd, ids, rlimits, path, list(spec.argv), env, root_caps)
            return child

        pid = _on_thread(ex, conf, lambda own_thread: _inside(ex, conf, lambda: fork(own_thread), stay=own_thread))
        os.close(err_w)
        rlimits = []   # the child set them itself
    for fd in (go_r, out_w, ep_w):
        os.close(fd)
    for s in run.streams:
        os.set_blocking(s.rfd, False)
    run.handle.pid = run.handle.pgid = pid
    if ex.spawn_mode == "fork":
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass  # the child did it already (or died: reported through the err pipe)
    if ex.guard is not None:   # before it can exec: no run of ours outlives the agent
        ex.guard.add(pid, run.slot.paths.values() if run.slot is not None else ())
    try:
        run.pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        run.pidfd = None   # kernel < 5.3: the reaper polls waitpid instead
    try:
        ex.backend.attach(run.slot, pid)
        for res, soft, hard in rlimits:   # fork mode's child set them itself: none left here
            resource.prlimit(pid, res, (soft, hard))
        for hook in list(ex.poststart):
            try:
                hook(run.handle)
            except Exception as exc:
                raise SpawnError("poststart", f"poststart hook {getattr(hook, '__qualname__', hook)} failed: {exc}") from None
        if arm_at is not None:
            try:   # confined and known: from now on its own timer may release it
                os.write(go_w, b"a\n")
            except BrokenPipeError:
                raise SpawnError("exec", "the launcher exited before it was armed") from None
            run.armed_at = arm_at
    except (OSError, SpawnError) as exc:  # never exec a run we could not confine or track
        if not isinstance(exc, SpawnError):
            exc = SpawnError("cgroup", f"cannot confine the run: {exc.strerror or exc}")
        kill(pid)
        run.error = str(exc)
        m.SPAWN_ERRORS.labels(exc.stage).inc()
        os.close(go_w)
        go_w = -1
    ex.runs.hold(run, GoPipe(go_w, err_r, path, cwd))
    if not hold or run.error:
        go(ex, run)


def _on_thread(ex: "Executor", conf: Optional[Confinement], launch: Any, own: bool = False) -> int:
    """launch(own_thread) on the thread a confined run's launcher comes from: the caller's,
    or one of its own (``own``, or a root run; own_thread: it ends after the spawn)."""
    if conf is None or ex.isolation is None:
        return launch(False)
    try:
        return ex.isolation.start_thread(conf, launch, own=own)
    except SpawnError:
        raise
    except OSError as exc:
        raise SpawnError("isolation", f"cannot confine the run: {exc.strerror or exc}") from None


def _inside(ex: "Executor", conf: Optional[Confinement], spawn: Any, stay: bool = False) -> int:
    """spawn() inside the run's namespaces when it is confined (``stay``: a thread that
    ends after it need not come back to the agent's)."""
    if conf is None or ex.isolation is None:
        return spawn()
    return ex.isolation.inside(conf, spawn, stay=stay)


def go(ex: "Executor", run: Run) -> None:
    """Release the launcher (one byte on the go pipe), then collect a fork-mode child's
    exec error. Caller's thread."""
    pipe = ex.runs.take_go(run)
    if pipe is None:
        return
    go_w, err_r, path, cwd = pipe
    spec = run.handle.spec
    released = False
    if go_w >= 0:
        now, run.t0 = time.time(), time.monotonic()
        armed = run.armed_at
        # an armed launcher went at its own due time, however late this thread is
        run.handle.started_at = now if armed is None else min(now, armed)
        if armed is not None and now > armed:
            run.t0 -= now - armed
        try:
            os.write(go_w, b"g\n")
            released = True
        except BrokenPipeError:
            # the child died during setup (its reason is in the err pipe), or an armed
            # launcher passed its due time and exec'd the job (its stdin is /dev/null now)
            released = armed is not None
        finally:
            os.close(go_w)
    msg = b""
    while err_r >= 0:
        try:
            chunk = os.read(err_r, 1024)
        except InterruptedError:
            continue
        if not chunk:
            os.close(err_r)
            break
        msg += chunk
    if msg:
        stage, _, rest = msg.decode(errors="replace").partition(":")
        code, _, text = rest.partition(":")
        detail = os.strerror(int(code)) if code.isdigit() and int(code) else text
        what = {"exec": f"exec {path}", "chdir": f"chdir {cwd}", "user": f"switch to user {spec.user}",
                "rlimit": "set rlimits"}.get(stage, stage)
        run.error = f"{what}: {detail}"
        m.SPAWN_ERRORS.labels(stage if stage in ("exec", "chdir", "user", "rlimit", "stdio") else "child").inc()
    elif not released and run.error is None:
        run.error = "the child exited before exec"
    if run.error:
        log.warning("run could not start", extra={"fields": {"run": spec.run_key, "error": run.error}})

