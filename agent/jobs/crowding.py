"""A firing due while another firing of its job has not started yet (it waits for its
dependencies, node quota, a pause or a start policy): at most one firing of a job waits,
so a per-second cron job that cannot start does not pile up a firing a second.

Which one waits is the job's overlap policy (forbid: the new one is misfired ``overlap``;
replace: it takes the waiting one's place), except behind a maintenance window, where the
misfire policy decides what the firings due outside it become: ``run_once``: the newest
waits (the one before is misfired ``window``); ``run_all``: the new one's due time joins
the job's backlog (they run one after another once the window opens), at most
``misfire_limit`` firings in all, the oldest misfired ``window`` beyond; ``skip``: none of
them waited (agent/jobs/windows.py ends them at once). A retry waiting for its window is
not a misfire: it keeps its place, as under forbid.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from agent.jobs.metrics import FIRINGS
from agent.jobs.states import EndReason
from agent.jobs.window import WAIT_REASON

if TYPE_CHECKING:
    from agent.jobs.catalog import JobEntry
    from agent.jobs.firing import Firing


class Crowding:
    def __init__(self, unqueue: Callable[[Firing], None], misfire: Callable[[Firing, str], None]):
        self.unqueue = unqueue     # a waiting firing leaves its queues and timers
        self.misfire = misfire     # a firing ends without a run: recorded misfired with this reason

    def admit(self, e: JobEntry, f: Firing, queued: list[Firing]) -> bool:
        """``f`` fell due while ``queued`` wait: True when it goes on to its start policies,
        False when it was dealt with here."""
        job = e.job
        behind = [g for g in queued if g.wait_reason == WAIT_REASON and g.claim.record is None]
        if behind and job.misfire == "run_all":
            if e.firings.get(f.fire_id) is f:
                del e.firings[f.fire_id]
            e.backlog.append(f.due)
            if 1 + len(e.backlog) > job.misfire_limit:
                for g in behind:   # the oldest goes; the backlog's next one waits in its place
                    self.unqueue(g)
                    self.misfire(g, WAIT_REASON)
            return False
        if (behind and job.misfire == "run_once") or job.overlap == "replace":
            for g in queued:
                self.unqueue(g)
                self.misfire(g, WAIT_REASON if any(g is b for b in behind) else EndReason.REPLACED)
            return True
        FIRINGS.labels("overlap_skipped").inc()
        self.misfire(f, "overlap")
        return False
