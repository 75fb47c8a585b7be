"""Helpers shared by the test suites and the benchmarks; fixtures live in the conftest.py
files (a real etcd, a 3-member etcd cluster, a real mosquitto). One home per helper:

- waiting: ``wait_for``, polling a condition until a deadline.
- cluster: ``Cluster``, real `millwright run` agent processes on one etcd (signed job
  store, ownership, run records, audit, statuses); ``recording_cluster``.
- local_agent: the Daemon `millwright run` builds, on a thread of the test, for fault injection.
- jobs: the side-effect recording workload (templates, job documents, effects).
- records: run records in etcd, audit records on disk, statuses in an agent's outbox.
- documents: a fixed clock, key and cluster for unit tests of job documents.
- cloud: agents wired to a broker (``CloudWorld``), a pusher, what agents answered.
- cloudkit: signing keys, bound job and cancel documents, a signing job store, a status
  collector on a real broker.
- link: ``FakeLink``, the one fake of the MQTT ``Link`` Protocol.
- network: cutting an address off with nftables.
- fakes: a manual clock and a manual event loop for unit tests of pure logic.
- commands: running the `millwright` command under test.
- processes: job processes seen from the test (results, fds, zombies, process groups).
- kernel: what kernel tests need from the machine (``require_kernel``).
- history, chaos: the strict history checker and the seeded fault test.

agent/demo/services.py (etcd, mosquitto and agent child processes) is shared with the
demo, so it stays in the product.
"""
