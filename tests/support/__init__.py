"""Helpers shared by the test suites (fixtures live in the conftest.py files): records, audit,
processes, the kernel, the cloud, and the strict history checker and fault-test harness."""
