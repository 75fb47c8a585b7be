"""The etcd worker pool starts threads on demand and lets idle ones go: a burst gets the
whole pool, every submission runs and is answered once, a one-thread pool keeps order,
and an idle pool ends up with no threads (and starts again on the next submission)."""

from __future__ import annotations

import queue
import threading
import time

from agent.coordination.worker import EtcdWorkers
from tests.support.waiting import wait_for


class Loop:
    """Stands in for EventLoop.post: runs the posted callbacks on the test's thread."""

    def __init__(self) -> None:
        self.q: "queue.SimpleQueue" = queue.SimpleQueue()

    def post(self, fn, *args) -> None:
        self.q.put((fn, args))

    def run_until(self, done, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < end, "timed out"
            try:
                fn, args = self.q.get(timeout=0.05)
            except queue.Empty:
                continue
            fn(*args)


def test_a_burst_gets_the_whole_pool_and_every_item_is_answered_once():
    loop = Loop()
    w = EtcdWorkers(loop.post, threads=4, name="t-burst", linger_s=30)
    w.start()
    gate = threading.Event()
    running: set[str] = set()
    lock = threading.Lock()
    answers: list[int] = []

    def job(i: int):
        with lock:
            running.add(threading.current_thread().name)
        gate.wait()
        return i

    for i in range(20):
        w.submit(lambda i=i: job(i), lambda r, e: answers.append(r))
    wait_for(lambda: len(running) == 4, 10, interval=0.01, what="four blocked at once: the pool grew to its size")
    assert w.threads == 4
    gate.set()
    loop.run_until(lambda: len(answers) == 20)
    assert sorted(answers) == list(range(20))
    assert w.pending == 0
    w.stop()
    assert w.threads == 0


def test_errors_reach_the_callback():
    loop = Loop()
    w = EtcdWorkers(loop.post, threads=1, name="t-err")
    w.start()
    got: list = []

    def boom():
        raise ValueError("nope")

    w.submit(boom, lambda r, e: got.append((r, e)))
    loop.run_until(lambda: got)
    assert got[0][0] is None and isinstance(got[0][1], ValueError)
    w.stop()


def test_one_thread_keeps_submission_order():
    loop = Loop()
    w = EtcdWorkers(loop.post, threads=1, name="t-order", linger_s=0.01)
    w.start()
    order: list[int] = []
    for i in range(200):
        w.submit(lambda i=i: order.append(i) or i, lambda r, e: None)
        if i % 37 == 0:
            time.sleep(0.03)  # let the worker go idle and end in between
    loop.run_until(lambda: w.pending == 0)
    assert order == list(range(200))
    w.stop()


def test_idle_workers_end_and_come_back_on_demand():
    loop = Loop()
    w = EtcdWorkers(loop.post, threads=3, name="t-linger", linger_s=0.05)
    w.start()
    assert w.threads == 0          # nothing submitted: no thread
    done: list[int] = []
    for i in range(10):
        w.submit(lambda i=i: i, lambda r, e: done.append(r))
    loop.run_until(lambda: len(done) == 10)
    wait_for(lambda: w.threads == 0, 10, interval=0.01, what="the idle pool's threads to end")
    for i in range(10, 20):        # after they ended, work starts threads again
        w.submit(lambda i=i: i, lambda r, e: done.append(r))
    loop.run_until(lambda: len(done) == 20)
    assert sorted(done) == list(range(20))
    w.stop()


def test_work_submitted_before_start_runs_after_start():
    loop = Loop()
    w = EtcdWorkers(loop.post, threads=2, name="t-early")
    done: list[int] = []
    for i in range(5):
        w.submit(lambda i=i: i, lambda r, e: done.append(r))
    assert w.threads == 0
    w.start()
    loop.run_until(lambda: len(done) == 5)
    w.stop()


def test_many_submitters_racing_idle_timeouts_lose_nothing():
    """Submissions from several threads while workers keep timing out (linger ~0): every
    item runs exactly once."""
    loop = Loop()
    w = EtcdWorkers(loop.post, threads=3, name="t-race", linger_s=0.001)
    w.start()
    ran: list[int] = []
    lock = threading.Lock()
    answered: list[int] = []

    def job(i: int) -> int:
        with lock:
            ran.append(i)
        return i

    # submit() is called from the loop thread in the agent; here several threads take turns
    # holding a lock around it, as the loop would serialize them
    submit_lock = threading.Lock()

    def submitter(base: int) -> None:
        for i in range(base, base + 300):
            with submit_lock:
                w.submit(lambda i=i: job(i), lambda r, e: answered.append(r))
            if i % 50 == 0:
                time.sleep(0.005)

    ts = [threading.Thread(target=submitter, args=(k * 1000,)) for k in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    loop.run_until(lambda: len(answered) == 900)
    assert sorted(ran) == sorted(answered) == sorted(k * 1000 + i for k in range(3) for i in range(300))
    w.stop()
