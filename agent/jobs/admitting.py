"""Between a firing that may start and its claim: held while new runs are paused (the lease
policy's early fence) or the agent drains, waiting while the node's quota is short
(agent/execute/admission.py), then handed to the claim."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Optional

from agent.execute.admission import ADMITTED, REJECTED
from agent.jobs.firing import Firing, FiringState
from agent.jobs.states import JobState

if TYPE_CHECKING:
    from agent.execute.admission import Admission
    from agent.jobs.catalog import JobEntry
    from agent.jobs.launching import Launcher
    from agent.jobs.statuses import Statuses

log = logging.getLogger(__name__)

S = FiringState


class Admitter:
    """Owns the firings waiting for quota or held (loop thread)."""

    def __init__(self, admission: Admission, launcher: Launcher, statuses: Statuses,
                 is_current: Callable[[JobEntry], bool], claim: Callable[[Firing, bool], None],
                 never_fits: Callable[[Firing], None]):
        self.admission = admission
        self.launcher = launcher
        self.statuses = statuses
        self.is_current = is_current
        self.claim = claim              # admitted: claim it (retry: its next attempt)
        self.never_fits = never_fits    # its limits exceed the node's budget: it fails
        self.waiting: dict[str, Firing] = {}      # admission key -> firing
        self.paused: Optional[str] = None         # early fence: no new runs start while set
        self.draining = False                     # graceful stop: nothing new is claimed
        self.held: list[Firing] = []              # firings that fell due while paused

    def request(self, f: Firing, retry: bool = False) -> None:
        """A firing may start (retry: its next attempt may): claim it once admitted."""
        if not retry and (self.paused is not None or self.draining):
            f.move(S.HELD)
            self.held.append(f)
            return
        # from here only the agent's own queues delay it: a wait for the node's budget is
        # one (past capacity the runs in flight hold it), and the loop's lag counts it
        f.mark_ready()
        f.limits = self.launcher.limits(f.entry)
        decision = self.admission.request(f.key, f.due.timestamp(), f.limits)
        if decision == ADMITTED:
            self.claim(f, retry)
        elif decision == REJECTED:
            self.never_fits(f)
        else:
            if retry:
                f.move(S.RETRYING_ADMISSION)
            else:
                f.move(S.WAITING, wait_reason="quota")
                self.statuses.send(f.entry, f, JobState.WAITING, reason="quota")
            self.waiting[f.key] = f

    def admit(self, keys: list[str]) -> None:
        """Claim the firings admission just let in. A key whose firing is gone is released
        at once, and whatever that release admits is dispatched too (never dropped: a
        dropped admission would hold node budget forever)."""
        work = list(keys)
        while work:
            k = work.pop(0)
            f = self.waiting.pop(k, None)
            if f is None or self.draining:
                if f is not None:   # stopping: claim nothing new (the next owner will)
                    f.move(S.HELD)
                    self.held.append(f)
                work.extend(self.admission.release(k))
                continue
            self.claim(f, f.state == S.RETRYING_ADMISSION)

    def release(self, f: Firing) -> None:
        """The firing's run ended or it will not run: its slot goes to the next."""
        self.admit(self.admission.release(f.key))

    def withdraw(self, f: Firing) -> bool:
        """A waiting firing leaves the queue (True), or it was not waiting (False)."""
        if self.waiting.pop(f.key, None) is None:
            return False
        self.admit(self.admission.cancel(f.key))
        return True

    def pause(self, reason: str) -> None:
        if self.paused is None:
            log.warning("new runs paused", extra={"fields": {"reason": reason}})
        self.paused = reason or "paused"

    def resume(self) -> None:
        if self.paused is None:
            return
        log.info("new runs resumed", extra={"fields": {"held": len(self.held)}})
        self.paused = None
        held, self.held = sorted(self.held, key=lambda f: f.due), []
        for f in held:
            if f.state == S.HELD and self.is_current(f.entry):
                self.request(f)

    def status(self) -> dict:
        return {"running": len(self.admission.running), "waiting": len(self.admission)}
