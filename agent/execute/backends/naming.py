"""Names in the cgroup trees and the run directories: the agent's cgroup root, and a run's
cgroup and directory name for its run key."""

from __future__ import annotations

import hashlib
import os
import re

PACKAGED_STATE_DIR = "/var/lib/millwright"


def run_root_name(agent_id: str, state_dir: str) -> str:
    """The agent's cgroup root: one per agent id, so that several agents on one host (tests,
    demo) never reclaim each other's runs; and per state dir unless it is the packaged one,
    so that two test clusters on one host with the same agent ids stay apart too."""
    name = "millwright-" + re.sub(r"[^A-Za-z0-9._-]", "_", agent_id)[:50]
    state_dir = os.path.abspath(state_dir)
    if state_dir != PACKAGED_STATE_DIR:
        name += "-" + hashlib.sha256(state_dir.encode()).hexdigest()[:8]
    return name


def safe_name(key: str) -> str:
    """A cgroup / directory name for a run key: readable prefix + collision-proof hash."""
    prefix = re.sub(r"[^A-Za-z0-9._-]", "_", key)[:80].lstrip(".") or "run"
    return f"{prefix}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
