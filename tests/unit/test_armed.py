"""Which armed launcher the executor uses (agent/execute/armed.py): lksh where mksh is
installed, else bash (Essential on Debian), else none. The scripts themselves run in
tests/kernel/test_armed_launcher.py."""

from __future__ import annotations

from agent.execute import armed


def test_lksh_where_installed_else_bash_else_none(monkeypatch):
    installed = {"/bin/lksh", "/bin/bash"}
    monkeypatch.setattr(armed.os, "access", lambda path, mode: path in installed)
    assert armed.pick_launcher() == armed.LKSH == ("/bin/lksh", armed.KSH_SCRIPT)
    installed.discard("/bin/lksh")
    assert armed.pick_launcher() == armed.BASH
    installed.clear()
    assert armed.pick_launcher() is None
