"""Coordination through etcd: session lease, membership, shard ownership, fencing."""
