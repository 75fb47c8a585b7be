"""Support code the test suites share: the strict history checker and the fault-test harness."""
