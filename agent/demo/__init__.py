"""`millwright demo` and the local services tests and benchmarks start.

Modules: services (etcd, mosquitto and agent child processes on loopback), plan (the
demo's jobs and what each should show), console (the cloud side: pushes and statuses
over MQTT), scenario (setup, pushes, the failover, cleanup), report (the checks against
etcd, side effects, audit logs and metrics, and the summary), output (live lines).

May import anything; nothing in the product imports it except the CLI.
"""
