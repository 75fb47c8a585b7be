"""`millwright demo` and the local services tests and benchmarks start.

Modules: services (etcd, mosquitto and agent child processes on loopback),
scenario (the demo: agents, pushes, a failover, live output and checks).

May import anything; nothing in the product imports it except the CLI.
"""
