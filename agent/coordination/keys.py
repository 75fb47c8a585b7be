"""The etcd key layout of the v1 contract, in one place.

Any tool can find where a job lives from its id alone: the shard is the first 8 bytes
of sha256(id), big-endian, modulo the shard count.
"""

from __future__ import annotations

import hashlib


def shard_of(job_id: str, shards: int) -> int:
    return int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big") % shards


class Keys:
    def __init__(self, cluster: str):
        self.prefix = f"/millwright/{cluster}/"

    @staticmethod
    def shard_name(shard: int) -> str:
        return f"{shard:04d}"

    def members_prefix(self) -> str:
        return self.prefix + "members/"

    def member(self, agent_id: str) -> str:
        return self.members_prefix() + agent_id

    def shards_prefix(self) -> str:
        return self.prefix + "shards/"

    def shard(self, shard: int) -> str:
        return self.shards_prefix() + self.shard_name(shard)

    def shard_number(self, key: str) -> int:
        return int(key[len(self.shards_prefix()):])

    def jobs_prefix(self, shard: int | None = None) -> str:
        p = self.prefix + "jobs/"
        return p if shard is None else p + self.shard_name(shard) + "/"

    def job(self, shard: int, job_id: str) -> str:
        return self.jobs_prefix(shard) + job_id

    def runs_prefix(self, shard: int | None = None, job_id: str | None = None) -> str:
        p = self.prefix + "runs/"
        if shard is None:
            return p
        p += self.shard_name(shard) + "/"
        return p if job_id is None else p + job_id + "/"

    def run(self, shard: int, job_id: str, fire_id: str) -> str:
        return self.runs_prefix(shard, job_id) + fire_id

    def answers_prefix(self, shard: int | None = None) -> str:
        """Answers not yet acknowledged by the broker (agent/cloud/answers.py)."""
        p = self.prefix + "answers/"
        return p if shard is None else p + self.shard_name(shard) + "/"

    def answer(self, shard: int, job_id: str, name: str) -> str:
        """name: ``accepted``, ``rejected.<push_sha256>`` or ``run.<fire_id>``."""
        return self.answers_prefix(shard) + job_id + "/" + name

    def usage_prefix(self) -> str:
        return self.prefix + "usage/"

    def usage(self, shard: int) -> str:
        """What a storage shard's job documents take: {jobs, bytes}, kept by its owner."""
        return self.usage_prefix() + self.shard_name(shard)

    def latest_prefix(self, shard: int | None = None) -> str:
        p = self.prefix + "latest/"
        return p if shard is None else p + self.shard_name(shard) + "/"

    def latest(self, shard: int, job_id: str) -> str:
        """A copy of the job's newest run record (by fire_id): depends_on reads one key."""
        return self.latest_prefix(shard) + job_id

    # --- staged rollouts (agent/jobs/rollouts.py) ---------------------------------------
    def rollouts_prefix(self, agent_id: str | None = None, shard: int | None = None,
                        job_id: str | None = None) -> str:
        """Rollout state, per agent: ``rollouts/<agent>/<shard>/<job>/`` holds that agent's
        abort mark of the job and, per firing, its start claim, start and outcome. Each agent
        writes only under its own ``rollouts/<agent>/`` (etcd RBAC, etcd-rbac.sh); what a
        rollout allows is derived from every agent's keys (agent/jobs/rollout.py)."""
        p = self.prefix + "rollouts/"
        if agent_id is None:
            return p
        p += agent_id + "/"
        if shard is None:
            return p
        p += self.shard_name(shard) + "/"
        return p if job_id is None else p + job_id + "/"

    def split_rollout_key(self, key: str) -> tuple[str, int, str, str] | None:
        """(agent, shard, job, rest) of a key under rollouts/ (None: not one)."""
        top = self.rollouts_prefix()
        if not key.startswith(top):
            return None
        parts = key[len(top):].split("/", 3)
        if len(parts) < 4 or not parts[0] or not parts[1].isdigit() or not parts[2] or not parts[3]:
            return None
        return parts[0], int(parts[1]), parts[2], parts[3]

    def waiting_prefix(self, shard: int | None = None, job_id: str | None = None) -> str:
        p = self.prefix + "waiting/"
        if shard is None:
            return p
        p += self.shard_name(shard) + "/"
        return p if job_id is None else p + job_id + "/"

    def rollout_aborted(self, agent_id: str, shard: int, job_id: str) -> str:
        """Written once by an agent that judged the rollout crossed its abort threshold."""
        return self.rollouts_prefix(agent_id, shard, job_id) + "aborted"

    def rollout_firing(self, agent_id: str, shard: int, job_id: str, base_fire_id: str) -> str:
        """The prefix of an agent's keys of one firing (``base_fire_id``: the fire id without
        @agent): ``claim``, ``start``, ``outcome``."""
        return self.rollouts_prefix(agent_id, shard, job_id) + base_fire_id + "/"

    def waiting(self, shard: int, job_id: str, agent_id: str) -> str:
        """A firing of the job waits on a start policy (window, gate) on that agent: what
        `jobs show` and `jobs/get` show; bound to the agent's session lease."""
        return self.waiting_prefix(shard, job_id) + agent_id

    # --- placement pools (targeting) ----------------------------------------------------
    def pools_prefix(self) -> str:
        return self.prefix + "pools/"

    def pool_spec(self, pool: str) -> str:
        """The pool's canonical target (JSON): written with the first job of the pool."""
        return self.pools_prefix() + pool + "/spec"

    def pool_shards_prefix(self, pool: str, agent: str | None = None) -> str:
        """Lease-bound shard keys of a pool; a fan-out pool has a shard space per agent."""
        p = self.pools_prefix() + pool + "/"
        return p + "shards/" if agent is None else p + "agents/" + agent + "/shards/"


class PoolKeys(Keys):
    """Keys as seen by a pool's shard manager: its shard keys live under the pool."""

    def __init__(self, cluster: str, pool: str, agent: str | None = None):
        super().__init__(cluster)
        self.pool = pool
        self._shards = self.pool_shards_prefix(pool, agent)

    def shards_prefix(self) -> str:
        return self._shards
