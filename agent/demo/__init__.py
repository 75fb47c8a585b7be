"""`millwright demo` and the local services tests and benchmarks start.

Modules: services (etcd, mosquitto and agent child processes on loopback), pki (their
throwaway CA and certificates), plan (the demo's jobs and what each should show), console
(the cloud side: the signer's key, pushes and statuses over MQTT), scenario (the phases in
order), stage (the machine: services, agents, job user, nftables; cleanup), feed (statuses
as they arrive, printed live), failover (the kill and the takeover), result (what a run
produced), report (the checks against etcd, side effects, audit logs and metrics, and the
summary), output (live lines).

May import anything; nothing in the product imports it except the CLI.
"""
