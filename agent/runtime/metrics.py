"""Prometheus metrics: one registry for the whole agent.

Each module declares its own collectors against ``REGISTRY`` (names start with
``millwright_``, units in the name, labels of bounded cardinality: never a job id).
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)
log = logging.getLogger(__name__)


def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(name, doc, labels, registry=REGISTRY)


def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
    return Gauge(name, doc, labels, registry=REGISTRY)


def histogram(name: str, doc: str, labels: tuple[str, ...] = (), buckets=Histogram.DEFAULT_BUCKETS) -> Histogram:
    return Histogram(name, doc, labels, registry=REGISTRY, buckets=buckets)


def serve(listen: str) -> None:
    """Start the exporter thread on host:port (empty string: disabled)."""
    if not listen:
        return
    host, _, port = listen.rpartition(":")
    start_http_server(int(port), addr=host.strip("[]"), registry=REGISTRY)
    log.info("metrics exporter listening", extra={"fields": {"listen": listen}})


def sample(name: str, labels: dict | None = None) -> float | None:
    """Current value of a sample (tests and `status`)."""
    return REGISTRY.get_sample_value(name, labels or {})
