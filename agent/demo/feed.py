"""What the cloud console receives, printed live: presence changes and job statuses, one
line per notable event, and kept for the summary."""

from __future__ import annotations

import queue
from typing import Optional

from agent.demo.console import CloudConsole
from agent.demo.output import Live, fmt_ms, parse_rfc
from agent.demo.plan import DemoFailed, DemoJob
from agent.jobs.states import TERMINAL, JobState, RecordState


class StatusFeed:
    """Reads the console's queue on the demo's thread (:meth:`pump`). A status the agents
    publish twice (same agent and seq: the outbox's redelivery) is kept once."""

    def __init__(self, console: CloudConsole, live: Live):
        self.console = console
        self.live = live
        self.jobs: list[DemoJob] = []                    # set once pushed: names the statuses' jobs
        self.statuses: list[dict] = []                   # every status, in arrival order
        self.runs: dict[tuple, dict] = {}                # (job, run id, attempt) -> its first running status
        self.run_pids: dict[int, str] = {}               # pid of a run -> its agent
        self._seen_seq: set = set()

    def pump(self) -> None:
        """Print what arrived from the broker since the last call."""
        while True:
            try:
                ts, topic, doc = self.console.q.get_nowait()
            except queue.Empty:
                return
            if topic.endswith("/presence"):
                who = topic.split("/")[-2]
                reason = doc.get("reason")
                extra = " (last will: the broker lost the connection)" if reason == "connection_lost" else ""
                self.live.line(who, f"presence {doc.get('state')}{extra}")
                continue
            key = (doc.get("agent"), doc.get("seq"))
            if doc.get("seq") is not None:
                if key in self._seen_seq:
                    continue
                self._seen_seq.add(key)
            doc["_rx"] = ts
            self.statuses.append(doc)
            self._print_status(doc)

    def job(self, jid: Optional[str]) -> Optional[DemoJob]:
        for j in self.jobs:
            if j.id == jid:
                return j
        return None

    def _print_status(self, d: dict) -> None:
        state, jid, who = d.get("state"), d.get("job_id"), d.get("agent") or "?"
        j = self.job(jid)
        cron = j is not None and "cron" in j.doc.get("schedule", {})
        fid = d.get("fire_id")
        run = f" @{str(d.get('due'))[11:19]}" if cron and d.get("due") else ""
        if state == JobState.ACCEPTED:
            if j is not None and not j.accepted_by:
                j.accepted_by, j.shard = who, d.get("shard")
                self.live.line(who, f"accepted {jid} ({j.kind}), shard {d.get('shard')}")
            return
        if state == JobState.REJECTED:
            self.live.line(who, f"REJECTED {jid}: {d.get('reason')} {d.get('detail') or ''}")
            raise DemoFailed(f"the agents rejected {jid}: {d.get('reason')}: {d.get('detail')}")
        if state == JobState.SCHEDULED:
            return
        if state == RecordState.RUNNING:
            key = (jid, fid, d.get("attempt"))
            if key in self.runs:  # same run again: a health change
                ev = d.get("health_rule") or d.get("rule") or d.get("reason")
                self.live.line(who, f"health of {jid}{run}: {d.get('health')}" + (f" ({ev})" if ev else ""))
                return
            self.runs[key] = d
            if d.get("pid"):
                self.run_pids[int(d["pid"])] = who
            if cron:
                return
            due = parse_rfc(d.get("due"))
            ts = parse_rfc(d.get("ts"))
            late = f", {fmt_ms(max(0.0, (ts - due).total_seconds()))} after due" if due and ts else ""
            self.live.line(who, f"running {jid}{run} (attempt {d.get('attempt')}, pid {d.get('pid')}{late})")
            return
        if state in TERMINAL or state == RecordState.RETRYING:
            r = self.runs.get((jid, fid, d.get("attempt")))
            took = ""
            if r is not None:
                a, b = parse_rfc(r.get("ts")), parse_rfc(d.get("ts"))
                if a and b:
                    took = f" in {(b - a).total_seconds():.1f} s"
            bits = []
            if d.get("exit_code") is not None:
                bits.append(f"exit {d['exit_code']}")
            reason = d.get("reason")
            if reason and reason != state:
                bits.append(str(reason))
            health = d.get("health")
            if health and health != "healthy":
                bits.append(f"health {health}")
            if state == RecordState.RETRYING and d.get("retry_at"):
                bits.append(f"next attempt at {str(d['retry_at'])[11:23]}")
            usage = d.get("usage") or {}
            if usage.get("max_rss_bytes"):
                bits.append(f"max rss {usage['max_rss_bytes'] / 1048576:.0f} MiB")
            self.live.line(who, f"{state} {jid}{run}{took}" + (f" ({', '.join(bits)})" if bits else ""))
            return
        if state == JobState.WAITING:
            self.live.line(who, f"waiting {jid} ({d.get('reason')})")
