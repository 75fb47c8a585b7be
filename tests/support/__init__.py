"""Helpers shared by the test suites (fixtures live in the conftest.py files)."""
