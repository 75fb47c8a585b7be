"""The cloud channel over MQTT (docs/cloud.md).

Modules: topics (names), link (the Link Protocol every part talks through), mqtt (its paho
1.6/2.x implementation), ingest (the push/cancel pipeline), dispatch (routing messages from
the link to ingest: ownership, grace holds, acknowledgements), outbox (durable status
outbox), pacing (the connection's PUBLISHes kept to the broker's publish rate), answers (answers kept in etcd until delivered, republished by the shard's owner),
facts (an answer rebuilt from etcd), queries (signed
jobs/get), asking (its cloud side), ratelimit (token buckets), presence (presence
documents), broker (the broker's ACL and settings), profile (the broker's limits, and
what `config check` refuses for them), component (the daemon's part:
:class:`component.CloudComponent`, built and registered by the daemon's wiring).
Threat model: docs/security.md.
"""
