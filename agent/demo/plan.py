"""What the demo asks of the product: its maintenance jobs and their expected outcomes."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Optional

from agent.runtime.timefmt import format_rfc3339 as rfc

CRON_EVERY_S = 5
GATE_OPENS_AT = 12.0     # s after the push: line 1 reports "stopped" (at the latest 2 s before the kill)
WINDOW_ENDS_AT = 16.0    # s after the push: press-calibration-3's window closes on its run (before the kill)


class DemoFailed(Exception):
    """An invariant broke: the demo ends with exit code 1 and this reason."""


@dataclass
class DemoJob:
    doc: dict
    kind: str                         # what the job shows (printed)
    expect: str = "succeeded"         # succeeded | not_succeeded | any
    cron_expected: list = field(default_factory=list)  # due times of a cron job's firings
    accepted_by: Optional[str] = None
    shard: Optional[int] = None
    held: bool = False                # waits for a gate or a window by design: not counted as late

    @property
    def id(self) -> str:
        return self.doc["id"]

    @property
    def category(self) -> str:
        if self.kind in ("network stall", "exec policy", "memory limit"):
            return "misbehaving"
        sch = self.doc.get("schedule") or {}
        return "cron" if "cron" in sch else "at" if "at" in sch else "delayed" if "delay_s" in sch else "immediate"


def plan_jobs(t0: datetime, duration: float, kill_at: float) -> list[DemoJob]:
    """The maintenance jobs of the scenario; times are relative to t0 (the push)."""
    issued = t0.replace(microsecond=(t0.microsecond // 1000) * 1000)
    far = issued + timedelta(minutes=30)
    stall_timeout = int(max(5, min(12, kill_at - 4)))
    jobs: list[DemoJob] = []

    line1, line2 = {"labels": {"line": "1"}}, {"labels": {"line": "2"}}  # targets: the gateways of a line

    def add(jid, template, params, schedule, kind, expect="succeeded", **kw):
        doc = {"v": 1, "id": jid, "template": template, "params": params, "schedule": schedule,
               "issued_at": rfc(issued), "not_after": rfc(far), "timeout_s": 60,
               "retry": {"max_attempts": 2, "backoff_s": 1, "max_backoff_s": 5, "jitter": 0}}
        doc.update({k: v for k, v in kw.items() if v is not None})
        jobs.append(DemoJob(doc, kind, expect))
        return jobs[-1]

    # immediate
    add("oil-check-line1", "oil-check", {"line": "1"}, {}, "immediate", target=line1)
    add("oil-check-line2", "oil-check", {"line": "2"}, {}, "immediate", target=line2)
    add("firmware-fetch-press4", "firmware-fetch", {"image": "press-ctl-4.2"}, {}, "network stall", "any",
        timeout_s=stall_timeout, retry={"max_attempts": 1})
    add("line-diagnostics-line2", "line-diagnostics", {"line": "2"}, {}, "exec policy", "any",
        retry={"max_attempts": 1}, target=line2)
    add("vision-warmup-cam1", "vision-warmup", {"mb": "256"}, {}, "memory limit", "not_succeeded",
        resources={"memory_mb": 48, "cpu": 0.5}, retry={"max_attempts": 1})
    # delayed (relative to issued_at)
    add("coolant-flush-line3", "coolant-flush", {"line": "3"}, {"delay_s": 6}, "delayed 6 s")
    late = int(duration * 0.6)
    add("coolant-flush-line4", "coolant-flush", {"line": "4"}, {"delay_s": late}, f"delayed {late} s")
    # at: spread over the scenario, most of them after the kill
    span = duration - 12.0
    for i in range(6):
        at = t0 + timedelta(seconds=5.0 + i * span / 5)
        add(f"filter-swap-press{i + 1}", "filter-swap", {"press": str(i + 1)}, {"at": rfc(at)},
            f"at +{(at - t0).total_seconds():.0f} s", target=line2 if i % 2 else None)
    # a long run that is in progress when the agent is killed (if its agent is the victim)
    at = t0 + timedelta(seconds=kill_at - 2)
    # (calibration can be repeated safely: it opts into owner_lost retries, see retry.on)
    add("press-calibration-2", "press-calibration", {"press": "2", "seconds": "5"}, {"at": rfc(at)},
        f"at +{kill_at - 2:.0f} s, runs 5 s",
        retry={"max_attempts": 2, "backoff_s": 1, "max_backoff_s": 5, "jitter": 0,
               "on": ["failed", "timed_out", "owner_lost"]}, target=line2)
    # the plant's rules: a job held by a closed production gate (line 1 reports "running"
    # until GATE_OPENS_AT), and a long run stopped when its maintenance window ends
    add("spindle-check-line1", "spindle-check", {"line": "1"}, {}, "gate: held while line 1 runs").held = True
    closes = min(WINDOW_ENDS_AT, kill_at - 1.5)
    win = [{"start": rfc(t0 + timedelta(seconds=2)), "end": rfc(t0 + timedelta(seconds=closes))}]
    add("press-calibration-3", "press-calibration", {"press": "3", "seconds": "40"},
        {"at": rfc(t0 + timedelta(seconds=3))}, f"window ends +{closes:g} s (end: stop)", "not_succeeded",
        window={"ranges": win, "end": "stop"}).held = True
    # cron with seconds, bounded by not_after
    end = t0 + timedelta(seconds=duration - 4)
    grid_end = datetime.fromtimestamp((int(end.timestamp()) // CRON_EVERY_S) * CRON_EVERY_S, timezone.utc)
    not_after = grid_end + timedelta(seconds=2.5)
    for line in (1, 2, 3):
        j = add(f"vibration-sample-line{line}", "vibration-sample", {"line": str(line)},
                {"cron": f"*/{CRON_EVERY_S} * * * * *", "tz": "Europe/Berlin"}, f"cron */{CRON_EVERY_S} s",
                misfire="run_all", misfire_limit=3, overlap="forbid", not_after=rfc(not_after),
                target={1: line1, 2: line2}.get(line))
        g = (int(issued.timestamp() // CRON_EVERY_S) + 1) * CRON_EVERY_S
        while g < not_after.timestamp():
            j.cron_expected.append(datetime.fromtimestamp(g, timezone.utc))
            g += CRON_EVERY_S
    return jobs
