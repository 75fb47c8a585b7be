"""The cloud channel over MQTT (docs/cloud.md).

Modules: topics (names), mqtt (paho 1.6/2.x adapter), ingest (push/cancel pipeline and
dispatcher), outbox (durable status outbox), answers (answers kept in etcd until delivered,
republished by the shard's owner), queries (jobs/get), presence (presence documents), component
(wiring to the daemon). The daemon's factory is :func:`cloud_component`.
"""


def cloud_component(agent):
    from .component import CloudComponent

    return CloudComponent(agent)
