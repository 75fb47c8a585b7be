"""Prometheus metrics: one registry for the whole agent.

Each module declares its own collectors against ``REGISTRY`` (names start with
``millwright_``, units in the name, labels of bounded cardinality: never a job id).
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)
log = logging.getLogger(__name__)


class _FastLabels:
    """``labels(*values)`` finds a child made before without the checks, the conversion
    and the lock of prometheus_client's (a firing looks up some twenty children on the
    loop, the reaper and the workers); a new child, keywords or a bad call go the library's
    way. The same children: the library keeps them by their values as strings."""

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Any:
        children = getattr(self, "_metrics", None)   # (a parent's: label values -> child)
        if children is not None and labelvalues and not labelkwargs:
            key = labelvalues if all(type(v) is str for v in labelvalues) else tuple(str(v) for v in labelvalues)
            child = children.get(key)
            if child is not None:
                return child
        return super().labels(*labelvalues, **labelkwargs)  # type: ignore[misc]


class _Counter(_FastLabels, Counter):
    pass


class _Gauge(_FastLabels, Gauge):
    pass


class _Histogram(_FastLabels, Histogram):
    pass


def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return _Counter(name, doc, labels, registry=REGISTRY)


def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
    return _Gauge(name, doc, labels, registry=REGISTRY)


def histogram(name: str, doc: str, labels: tuple[str, ...] = (), buckets=Histogram.DEFAULT_BUCKETS) -> Histogram:
    return _Histogram(name, doc, labels, registry=REGISTRY, buckets=buckets)


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
