"""Millwright: an edge agent for factory maintenance jobs."""

__version__ = "0.1.0"
CONTRACT_VERSION = 1
