"""The cloud channel over MQTT (docs/cloud.md).

Modules: topics (names), link (the Link Protocol every part talks through), mqtt (its paho
1.6/2.x implementation), ingest (the push/cancel pipeline), dispatch (routing messages from
the link to ingest: ownership, grace holds, acknowledgements), outbox (durable status
outbox), answers (answers kept in etcd until delivered, republished by the shard's owner),
queries (jobs/get), presence (presence documents), component (wiring to the daemon). The daemon's factory is :func:`cloud_component`.
"""


def cloud_component(agent):
    from .component import CloudComponent

    return CloudComponent(agent)
