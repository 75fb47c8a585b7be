"""Backend probing and parsing helpers (no cgroup writes)."""

from __future__ import annotations

import resource

import pytest

from agent.execute import Limits, describe_backend, probe
from agent.execute.backends import (Cgroup1Backend, Cgroup2Backend, CgroupFS, RlimitBackend, mountinfo, parse_kv, safe_name,
                                    self_cgroups)
from agent.execute.runs import RunResult, rfc3339


def test_mountinfo_and_self_cgroup_parsing(tmp_path):
    mi = tmp_path / "mountinfo"
    mi.write_text(
        "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "31 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
        "35 25 0:31 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate\n"
        "40 1 8:1 / / rw - ext4 /dev/sda1 rw\n")
    got = mountinfo(str(mi))
    assert [(m, t) for m, t, _, _ in got] == [("/sys/fs/cgroup/memory", "cgroup"), ("/sys/fs/cgroup/cpu,cpuacct", "cgroup"),
                                              ("/sys/fs/cgroup/unified", "cgroup2")]
    assert "cpuacct" in got[1][2]
    cg = tmp_path / "cgroup"
    cg.write_text("4:memory:/a/b\n2:cpu,cpuacct:/c\n0::/system.slice/millwright.service\n")
    assert self_cgroups(str(cg)) == {"memory": "/a/b", "cpu": "/c", "cpuacct": "/c", "": "/system.slice/millwright.service"}
    assert parse_kv("max 3\noom_kill 1\nbad line here\n") == {"max": 3, "oom_kill": 1}


def test_safe_names_are_unique_and_harmless():
    a, b = safe_name("job/../x"), safe_name("job/__/x")
    assert a != b and "/" not in a and not a.startswith(".")
    assert safe_name("\n") .startswith("_-")
    assert len(safe_name("x" * 500)) < 100


def test_missing_controllers_make_cgroup1_unavailable():
    b = Cgroup1Backend(mounts={"memory": "/sys/fs/cgroup/memory"}, root_name="t")
    with pytest.raises(Exception, match="no cgroup v1 hierarchy for cpu, pids"):
        b.check_available()
    with pytest.raises(Exception, match="no cgroup2 mount"):
        Cgroup2Backend(mount="", self_path="/").check_available()
    with pytest.raises(ValueError):
        Cgroup1Backend(mounts={}, root_name="../evil")


def test_probe_always_finds_a_backend_and_says_why():
    line = describe_backend("auto")
    assert line.split()[0] in ("cgroup2", "cgroup1", "rlimit") and "(" in line
    assert describe_backend("rlimit").startswith("rlimit (last resort")
    with pytest.raises(ValueError):
        probe("systemd", setup=False)


def test_rlimit_values():
    rl = dict(RlimitBackend().child_rlimits(Limits(cpu=0.5, memory_mb=64, pids=10), timeout_s=100))
    assert rl == {resource.RLIMIT_AS: 128 << 20, resource.RLIMIT_CPU: 51, resource.RLIMIT_NPROC: 10}
    assert RlimitBackend().child_rlimits(Limits(), None) == []


def test_result_record_fields():
    r = RunResult(run_key="k", reason="succeeded", exit_code=0, started_at=0.0, ended_at=1.5, duration_s=1.5)
    d = r.to_dict()
    assert d["started_at"] == "1970-01-01T00:00:00.000Z" and d["ended_at"] == "1970-01-01T00:00:01.500Z"
    assert set(d["usage"]) == {"cpu_s", "max_rss_bytes", "oom_kills", "throttled_s"}
    assert rfc3339(None) is None


def test_config_check_names_the_quota_backend(tmp_path, capsys):
    from agent.cli import main

    cfg = tmp_path / "agent.yaml"
    cfg.write_text("cluster: t\nmqtt: {insecure: true}\nexecute: {quota_backend: rlimit}\netcd: {insecure: true}\n")
    assert main(["config", "check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "quota backend: rlimit (last resort" in out


class _DirFS(CgroupFS):
    """Directories in a set, writes kept: enough for the backends' layout code."""

    def __init__(self, dirs=()):
        self.dirs: set[str] = set(dirs)
        self.writes: dict[str, str] = {}
        self.joiners: list[str] = []
        self.closed: list[int] = []

    def mkdir(self, path: str) -> None:
        self.dirs.add(path)

    def rmdir(self, path: str) -> None:
        self.dirs.discard(path)

    def isdir(self, path: str) -> bool:
        return path in self.dirs

    def listdir(self, path: str) -> list[str]:
        return [d.rsplit("/", 1)[1] for d in self.dirs if d.rsplit("/", 1)[0] == path]

    def writable(self, path: str) -> bool:
        return True

    def write(self, path: str, data: str) -> None:
        self.writes[path] = data

    def open_joiner(self, path: str) -> int:
        self.joiners.append(path)
        return 100 + len(self.joiners)

    def close_fd(self, fd: int) -> None:
        self.closed.append(fd)


def test_cgroup1_run_cpu_cgroups_are_top_level_and_found_again_when_stale():
    fs = _DirFS({"/m", "/c", "/p", "/a"})
    b = Cgroup1Backend(mounts={"memory": "/m", "cpu": "/c", "pids": "/p", "cpuacct": "/a"}, root_name="t", fs=fs)
    b.setup()
    assert b.roots == {"memory": "/m/t", "pids": "/p/t"}   # no root in cpu, cpuacct
    slot = b.create("r1", Limits(cpu=0.5, memory_mb=64, pids=8))
    assert slot.paths == {"memory": "/m/t/r1", "pids": "/p/t/r1", "cpu": "/c/t@r1", "cpuacct": "/a/t@r1"}
    # the launcher joins each by itself, through its `tasks` file kept open with the slot
    assert sorted(fs.joiners) == sorted(d + "/tasks" for d in slot.paths.values())
    assert fs.writes["/c/t@r1/cpu.cfs_quota_us"] == "50000"
    assert "/c/t/cpu.shares" not in fs.writes            # no weight of our own: one process's
    fs.mkdir("/c/t@r2")                                  # a dead agent's run, cpu cgroup left alone
    fs.mkdir("/c/t2@r3")                                 # another agent's run: not ours
    assert {s.name: s.paths["cpu"] for s in b.stale_slots()} == {"r1": "/c/t@r1", "r2": "/c/t@r2"}
    b.remove(slot)
    assert not fs.dirs & {"/m/t/r1", "/p/t/r1", "/c/t@r1", "/a/t@r1"}
    assert sorted(fs.closed) == [101, 102, 103, 104] and slot.join_fds == {}
