"""Job health policy and exec policy (agent/supervision/health.py): pure logic with a fake clock."""

from __future__ import annotations

import pytest

from agent.runtime import metrics
from agent.config import HealthThresholds, Template
from agent.supervision.health import (CLEAR_S, CONFIRM_S, DEGRADED, HEALTHY, LAUNCHER_MAX_EXECS, STALLED, ExecPolicy,
                          JobHealth, classify, normalise)
from agent.signals import ExecEvent, SlotSignals

T = HealthThresholds()  # degraded 1/s, stalled 3/s, stall_age 5 s, failed_connects 3


def sig(rate=0.0, age=0.0, stalled=0, fails=0, available=True, slot=1):
    return SlotSignals(slot=slot, available=available, retrans_per_s=rate, oldest_stall_age_s=age,
                       stalled_connections=stalled, failed_connects_in_window=fails)


def feed(h: JobHealth, samples, t0=0.0, dt=0.25):
    """Feed samples every dt seconds; returns the decisions with their times."""
    out = []
    t = t0
    for s in samples:
        t += dt
        d = h.observe(s, t)
        if d is not None:
            out.append(d)
    return out, t


# ---------------------------------------------------------------- classify

@pytest.mark.parametrize("s,state,rule,immediate", [
    (sig(), HEALTHY, "recovered", False),
    (sig(rate=0.99), HEALTHY, "recovered", False),
    (sig(rate=1.0), DEGRADED, "retrans_per_s_degraded", False),
    (sig(rate=3.0), STALLED, "retrans_per_s_stalled", False),
    (sig(fails=3), DEGRADED, "failed_connects", True),
    (sig(fails=2), HEALTHY, "recovered", False),
    (sig(age=5.0, stalled=1), STALLED, "stall_age", True),
    (sig(age=4.9, stalled=1), HEALTHY, "recovered", False),
    (sig(age=9.0, stalled=0), HEALTHY, "recovered", False),      # age without a stalled connection: ignored
    (sig(rate=3.5, age=6, stalled=2), STALLED, "stall_age", True),  # worst and immediate first
    (sig(rate=9, fails=9, available=False), HEALTHY, "recovered", False),  # degraded mode: no counts
    (sig(age=6, stalled=1, available=False), STALLED, "stall_age", True),  # ... but stalls still count
])
def test_classify_rules(s, state, rule, immediate):
    got_state, got_rule, got_immediate, ev = classify(s, T)
    assert (got_state, got_rule, got_immediate) == (state, rule, immediate)
    assert {"retrans_per_s", "oldest_stall_age_s", "stalled_connections", "failed_connects_in_window",
            "available"} <= set(ev)


def test_classify_uses_template_thresholds():
    t = HealthThresholds(retrans_per_s_degraded=0.1, retrans_per_s_stalled=0.5, stall_age_s=1.0, failed_connects=1)
    assert classify(sig(rate=0.2), t)[0] == DEGRADED
    assert classify(sig(rate=0.5), t)[0] == STALLED
    assert classify(sig(age=1.0, stalled=1), t)[0] == STALLED
    assert classify(sig(fails=1), t)[:2] == (DEGRADED, "failed_connects")


# ---------------------------------------------------------------- hysteresis

def test_one_bad_sample_never_changes_state():
    h = JobHealth(T, 0.0, track_metrics=False)
    ds, _ = feed(h, [sig(rate=10)] + [sig()] * 40)
    assert ds == [] and h.state == HEALTHY


def test_rate_stall_needs_confirmation_then_ends_run():
    h = JobHealth(T, 0.0, slot=7, track_metrics=False)
    ds, t = feed(h, [sig(rate=4)] * 5)  # 0.25 .. 1.25
    assert len(ds) == 1
    d = ds[0]
    assert (d.previous, d.state, d.rule, d.end_run, d.reason, d.slot) == (HEALTHY, STALLED, "retrans_per_s_stalled",
                                                                         True, "network_stall", 7)
    assert d.at == pytest.approx(0.25 + CONFIRM_S)
    assert d.evidence["retrans_per_s"] == 4 and d.evidence["threshold"] == 3.0
    assert d.evidence["confirmed_s"] == pytest.approx(CONFIRM_S)
    rec = d.to_record()
    assert rec["state"] == STALLED and rec["reason"] == "network_stall" and rec["slot"] == 7


def test_stall_age_is_immediate():
    h = JobHealth(T, 0.0, track_metrics=False)
    d = h.observe(sig(age=5.2, stalled=1), 3.0)
    assert d is not None and d.state == STALLED and d.rule == "stall_age" and d.end_run
    assert d.evidence["confirmed_s"] == 0


def test_failed_connects_is_immediate_degraded_and_not_ending():
    h = JobHealth(T, 0.0, track_metrics=False)
    d = h.observe(sig(fails=4), 1.0)
    assert d.state == DEGRADED and d.rule == "failed_connects" and not d.end_run and d.reason is None


def test_stalled_rate_not_yet_confirmed_confirms_degraded_first_when_it_started_earlier():
    h = JobHealth(T, 0.0, track_metrics=False)
    ds, _ = feed(h, [sig(rate=1.5)] * 3 + [sig(rate=3.5)] * 3)  # degraded from 0.25, stalled from 1.0
    assert [d.state for d in ds] == [DEGRADED]
    assert ds[0].at == pytest.approx(1.25)
    ds2, _ = feed(h, [sig(rate=3.5)] * 4, t0=1.5)
    assert [d.state for d in ds2] == [STALLED]
    assert ds2[0].at == pytest.approx(2.0)   # stalled-level held since t=1.0


def test_recovery_needs_clear_window():
    h = JobHealth(T, 0.0, track_metrics=False)
    ds, t = feed(h, [sig(rate=1.5)] * 6)
    assert [d.state for d in ds] == [DEGRADED]
    # healthy samples, interrupted once by a bad one: the clear window restarts
    ds, t = feed(h, [sig()] * 8 + [sig(rate=2)] + [sig()] * 11, t0=t)
    assert ds == []
    ds, t = feed(h, [sig()] * 2, t0=t)
    assert [(d.previous, d.state, d.rule) for d in ds] == [(DEGRADED, HEALTHY, "recovered")]
    assert ds[0].evidence["confirmed_s"] >= CLEAR_S


def test_stalled_is_sticky():
    h = JobHealth(T, 0.0, track_metrics=False)
    assert h.observe(sig(age=6, stalled=1), 1.0).state == STALLED
    ds, _ = feed(h, [sig()] * 40, t0=1.0)
    assert ds == [] and h.stalled


def test_periodic_reevaluation_catches_a_growing_stall_age():
    """on_signals does not fire while a stall only ages: the daemon re-samples on a timer."""
    h = JobHealth(T, 0.0, track_metrics=False)
    ages = [0.5 * i for i in range(1, 12)]
    ds = [d for a in ages if (d := h.observe(sig(age=a, stalled=1), 1.0 + a)) is not None]
    assert len(ds) == 1 and ds[0].rule == "stall_age" and ds[0].evidence["oldest_stall_age_s"] == 5.0


def test_zero_confirm_still_needs_two_samples():
    h = JobHealth(T, 0.0, confirm_s=0.0, track_metrics=False)
    assert h.observe(sig(rate=5), 1.0) is None
    assert h.observe(sig(rate=5), 1.1).state == STALLED


def test_end_on_stall_false_reports_only():
    h = JobHealth(T, 0.0, end_on_stall=False, track_metrics=False)
    d = h.observe(sig(age=9, stalled=1), 1.0)
    assert d.state == STALLED and not d.end_run and d.reason is None


def test_bad_hysteresis_arguments():
    with pytest.raises(ValueError):
        JobHealth(T, 0.0, confirm_s=-1, track_metrics=False)


def test_metrics_counted_and_gauge_follows_runs():
    def g(s):
        return metrics.sample("millwright_runs_by_health", {"state": s}) or 0.0

    def c(s):
        return metrics.sample("millwright_run_health_changes_total", {"state": s}) or 0.0

    g0 = {s: g(s) for s in (HEALTHY, DEGRADED, STALLED)}
    c0 = c(STALLED)
    a, b = JobHealth(T, 0.0), JobHealth(T, 0.0)
    assert g(HEALTHY) == g0[HEALTHY] + 2
    a.observe(sig(age=7, stalled=1), 1.0)
    assert (g(HEALTHY), g(STALLED)) == (g0[HEALTHY] + 1, g0[STALLED] + 1)
    assert c(STALLED) == c0 + 1
    a.close()
    a.close()  # idempotent
    b.close()
    assert {s: g(s) for s in (HEALTHY, DEGRADED, STALLED)} == g0
    assert a.status()["state"] == STALLED


# ---------------------------------------------------------------- exec policy

def test_normalise():
    assert normalise("/usr/lib/jobs/../../../bin/sh") == "/bin/sh"
    assert normalise("//usr//bin/./env") == "/usr/bin/env"
    assert normalise("relative/x") == "relative/x"


def test_allow_list_exact_and_globs():
    p = ExecPolicy(["/usr/bin/env", "/usr/lib/millwright/jobs/*", "/usr/bin/python3*", "/opt/t?ol", "/opt/[ab]x"])
    for ok in ("/usr/bin/env", "/usr/lib/millwright/jobs/flush", "/usr/lib/millwright/jobs/sub/dir/tool",
               "/usr/bin/python3", "/usr/bin/python3.11", "/opt/tool", "/opt/bx", "//usr/bin/env"):
        assert p.check(ok) is None, ok
        assert p.match(ok) is not None
    for bad in ("/usr/bin/curl", "/usr/lib/millwright/jobs", "/usr/lib/millwright/jobs/../../../../bin/sh",
                "/USR/BIN/ENV", "/opt/toool", "/opt/cx", "/usr/bin/env2"):
        v = p.check(bad)
        assert v is not None and v.rule == "allow_exec", bad


def test_star_crosses_slashes_documented():
    p = ExecPolicy(["/srv/*/run"])
    assert p.check("/srv/a/b/c/run") is None


def test_relative_filename_is_a_violation():
    v = ExecPolicy(["/usr/bin/*"]).check("bin/sh")
    assert v.rule == "relative_path" and v.action == "kill"


def test_modes_and_actions_and_metrics():
    def c(m):
        return metrics.sample("millwright_exec_policy_violations_total", {"mode": m}) or 0.0

    e0, m0 = c("enforce"), c("monitor")
    v = ExecPolicy([], "enforce").check("/usr/bin/curl", pid=42, argv=["curl", "x"])
    assert (v.action, v.reason, v.mode, v.pid, v.argv) == ("kill", "exec_policy", "enforce", 42, ("curl", "x"))
    assert v.to_record() == {"path": "/usr/bin/curl", "rule": "allow_exec", "mode": "enforce", "action": "killed",
                             "pid": 42, "argv": ["curl", "x"]}
    w = ExecPolicy([], "monitor").check("/usr/bin/curl")
    assert w.action == "record" and w.to_record()["action"] == "recorded"
    assert (v.verdict, w.verdict) == ("killed", "violation")
    assert (c("enforce"), c("monitor")) == (e0 + 1, m0 + 1)


def test_bad_policy_arguments():
    with pytest.raises(ValueError):
        ExecPolicy([], "audit")
    with pytest.raises(ValueError):
        ExecPolicy(["bin/*"])


def test_from_template():
    tpl = Template(argv=["/usr/lib/millwright/jobs/x"], allow_exec=["/usr/bin/python3*"])
    p = ExecPolicy.from_template(tpl, "monitor")
    assert p.mode == "monitor" and p.check("/usr/bin/python3") is None


# ---------------------------------------------------------------- launcher exemption

SHIM = ["/bin/sh", "/usr/bin/setpriv"]


def test_launcher_execs_before_the_job_program_are_allowed():
    r = ExecPolicy(["/usr/bin/python3*"]).for_run("/usr/lib/millwright/jobs/flush")
    assert r.launching
    assert r.check("/bin/sh") is None
    assert r.check("/usr/bin/setpriv") is None
    assert r.check("/usr/lib/millwright/jobs/flush") is None  # argv0: implicitly allowed, ends the launcher phase
    assert not r.launching
    assert r.check("/usr/bin/python3.11") is None
    v = r.check("/bin/sh")  # the job itself running a shell: not exempt any more
    assert v is not None and v.path == "/bin/sh"
    assert r.check("/usr/bin/setpriv") is not None
    assert r.violations == 2
    assert r.check("/usr/lib/millwright/jobs/flush") is None  # the job re-executing itself


def test_a_launcher_exec_delivered_after_the_job_exec_is_judged_by_its_exec_time():
    """Seen in the flap test: the shim's exec raced the pid's registration and reached the
    policy after setpriv and the job's own exec; judged by arrival it killed the run."""
    r = ExecPolicy(["/bin/true"]).for_run("/bin/true", job_argv=["/bin/true"])
    assert r.check("/usr/bin/setpriv", argv=["/usr/bin/setpriv", "--", "/bin/true"], exec_ts=100.002) is None
    assert r.check("/bin/true", argv=["/bin/true"], exec_ts=100.003) is None
    assert not r.launching
    late = r.check("/bin/sh", argv=["/bin/sh", "-c", "shim"], exec_ts=100.001)  # the launch's first exec
    assert late is None and r.violations == 0
    # the job running a shell after its own exec is still a violation
    v = r.check("/bin/sh", argv=["/bin/sh", "-c", "x"], exec_ts=100.010)
    assert v is not None and r.violations == 1


@pytest.mark.parametrize("shell,seen_as,script", [
    ("/bin/bash", "/bin/bash", "read -r m || exit 126"),
    # with mksh installed the armed launcher's shell is /bin/lksh (agent/execute/armed.py)
    ("/bin/lksh", "/usr/bin/lksh", "function w {"),
])
def test_armed_launcher_setpriv_then_its_shell_then_the_job_is_allowed_and_the_shell_after_it_is_not(
        shell, seen_as, script):
    """The armed launcher (issue 18) execs setpriv, then its shell with the armed script,
    then the job; the shell is a launcher path only until the job's own exec."""
    r = ExecPolicy([]).for_run("/opt/job", job_argv=["/opt/job", "x"])
    assert r.check("/usr/bin/setpriv", argv=["/usr/bin/setpriv", "--reuid=65534", "--", shell]) is None
    assert r.check(seen_as, argv=[shell, "-c", script, "millwright-run"]) is None
    assert r.check("/opt/job", argv=["/opt/job", "x"]) is None and not r.launching
    v = r.check(shell, argv=[shell, "-c", "x"])
    assert v is not None and r.violations == 1


def test_launcher_exemption_is_bounded():
    r = ExecPolicy([]).for_run("/opt/job")
    for _ in range(LAUNCHER_MAX_EXECS):
        assert r.check("/bin/sh") is None
    assert r.check("/bin/sh") is not None


def test_other_exec_during_launch_is_checked():
    r = ExecPolicy([]).for_run("/opt/job")
    assert r.check("/bin/sh") is None
    assert r.check("/usr/bin/curl") is not None
    assert r.launching  # still waiting for the job program


def test_argv0_not_implicit_when_disabled():
    r = ExecPolicy([]).for_run("/opt/job", allow_argv0=False)
    assert r.check("/bin/sh") is None
    v = r.check("/opt/job")
    assert v is not None and not r.launching


def test_fork_spawn_mode_without_launcher():
    r = ExecPolicy(["/usr/bin/*"]).for_run("/opt/job")
    assert r.check("/opt/job") is None and r.check("/usr/bin/tr") is None and r.check("/bin/tr") is not None


def test_check_event():
    r = ExecPolicy([], "monitor").for_run("/opt/job")
    ev = ExecEvent(pid=5, ppid=4, uid=0, gid=0, filename="/usr/bin/wget", argv=["wget", "u"], slot=3, ts=1.0)
    v = r.check_event(ev)
    assert v.pid == 5 and v.argv == ("wget", "u") and v.action == "record"
    assert r.check_event(ExecEvent(pid=6, ppid=5, uid=0, gid=0, filename="/opt/job", argv=[], slot=3, ts=2.0)) is None


def test_launcher_sh_does_not_end_the_launch_phase_of_a_job_whose_program_is_sh():
    """The executor's shim is /bin/sh too; the phase ends only at the job's own argv, so
    the shim's sh does not end it and the setpriv that follows is not flagged."""
    from agent.supervision.health import ExecPolicy

    job_argv = ["/bin/sh", "-c", "sleep 0.3; /usr/bin/id -u"]
    run = ExecPolicy(["/bin/sh", "/bin/sleep"], "enforce").for_run("/bin/sh", job_argv=job_argv)
    assert run.check("/bin/sh", argv=["/bin/sh", "-c", "exec launcher shim"]) is None
    assert run.check("/usr/bin/setpriv", argv=["/usr/bin/setpriv", "--reuid=65534", "--", *job_argv]) is None
    assert run.check("/bin/sh", argv=job_argv) is None
    assert not run.launching
    v = run.check("/usr/bin/id", argv=["/usr/bin/id", "-u"])
    assert v is not None and v.action == "kill"
    # a truncated argv from the kernel still matches as a prefix
    run2 = ExecPolicy([], "enforce").for_run("/bin/sh", job_argv=["/bin/sh", "-c", "x" * 300])
    assert run2.check("/bin/sh", argv=["/bin/sh", "-c", "x" * 127]) is None and not run2.launching


def test_proc_argv_of_a_raced_shim_exec_does_not_end_the_launch_phase():
    """The shim's exec can race the pid's registration: the kernel then has no argv and the
    sensor reads /proc/<pid>/cmdline later, which may already show the job's argv (seen in
    CI: the following setpriv was flagged). Such an argv must not end the launch phase."""
    job_argv = ["/bin/sh", "-c", "sleep 0.3; /usr/bin/id -u"]
    run = ExecPolicy(["/bin/sh"], "enforce").for_run("/bin/sh", job_argv=job_argv)
    assert run.check("/bin/sh", argv=job_argv, argv_source="proc") is None
    assert run.launching
    assert run.check("/usr/bin/setpriv", argv=["/usr/bin/setpriv", "--", *job_argv]) is None
    assert run.check("/bin/sh", argv=job_argv) is None and not run.launching
    assert run.check("/usr/bin/id", argv=["/usr/bin/id", "-u"]) is not None
    # a program that is not a launcher path ends the phase whatever the argv source
    run2 = ExecPolicy([], "enforce").for_run("/opt/job", job_argv=["/opt/job", "a"])
    ev = ExecEvent(pid=7, ppid=1, uid=0, gid=0, filename="/opt/job", argv=[], slot=1, ts=1.0, argv_source="none")
    assert run2.check_event(ev) is None and not run2.launching
