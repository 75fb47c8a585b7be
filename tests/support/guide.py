"""A Markdown guide run as a test: its ```sh blocks, in order, in one bash.

Each block's output goes to a file of its own (``<out>/block-NN.out``, ``.err``), so a test
can check what a documented command printed, and a failure names the block and its place
in the guide. Background processes the guide starts (``… &``) belong to the script's
process group, which :meth:`GuideRun.stop` ends whatever happened.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Optional

from agent.execute.processes import group_members

FENCE_RE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
HEADING_RE = re.compile(r"^(#{1,6}) +(.*?) *$", re.M)


@dataclass(frozen=True)
class Block:
    source: str   # file it comes from (relative to the repository)
    line: int     # line of its opening fence
    text: str

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


def shell_blocks(path: str, root: str, section: Optional[str] = None) -> list[Block]:
    """The ```sh blocks of the Markdown file ``path`` (relative to ``root``), or of its
    section under the heading ``section`` (up to the next heading of the same level)."""
    with open(os.path.join(root, path), encoding="utf-8") as fh:
        text = fh.read()
    start, end = 0, len(text)
    if section is not None:
        heads = list(HEADING_RE.finditer(text))
        found = [h for h in heads if h.group(2) == section]
        if not found:
            raise ValueError(f"{path}: no heading {section!r}")
        head = found[0]
        start = head.end()
        level = len(head.group(1))
        later = [h for h in heads if h.start() > head.start() and len(h.group(1)) <= level]
        end = later[0].start() if later else len(text)
    out = []
    for m in FENCE_RE.finditer(text, start, end):
        if m.group(1).strip() == "sh":
            out.append(Block(path, text.count("\n", 0, m.start()) + 1, m.group(2)))
    return out


class GuideRun:
    """The blocks run by one ``bash`` (``set -euo pipefail``; aliases expand as in an
    interactive shell) in ``cwd`` with ``env``; block i's output in ``out/block-i.*``."""

    def __init__(self, blocks: list[Block], out: str, cwd: str, env: dict):
        self.blocks = blocks
        self.out = out
        os.makedirs(out, exist_ok=True)
        lines = ["set -euo pipefail", "shopt -s expand_aliases"]
        for i, b in enumerate(blocks):
            # `exec` switches the shell's own output: a block may define an alias or set a
            # variable that later blocks use, which a `{ …; } > file` group would not allow
            lines += [f"exec >{self.path(i, 'out')} 2>{self.path(i, 'err')}",
                      f"echo {i} > {os.path.join(out, 'reached')}", f"# {b.where}", b.text]
        lines.append(f"echo done > {os.path.join(out, 'reached')}")
        self.script = os.path.join(out, "guide.sh")
        with open(self.script, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        self.proc = subprocess.Popen(["bash", self.script], cwd=cwd, env=env, start_new_session=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def path(self, i: int, stream: str) -> str:
        return os.path.join(self.out, f"block-{i:02d}.{stream}")

    def wait(self, timeout: float) -> int:
        """The script's exit status; raises subprocess.TimeoutExpired after ``timeout``."""
        return self.proc.wait(timeout)

    def reached(self) -> str:
        try:
            with open(os.path.join(self.out, "reached")) as fh:
                return fh.read().strip()
        except OSError:
            return "none"

    def output(self, i: int, stream: str = "out") -> str:
        try:
            with open(self.path(i, stream), errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""

    def block_of(self, command: str) -> int:
        """The index of the first block that contains ``command``."""
        for i, b in enumerate(self.blocks):
            if command in b.text:
                return i
        raise KeyError(f"no block runs {command!r}")

    def failure(self) -> str:
        """Where the run stopped, with that block's text and output: the message of a failed test."""
        got = self.reached()
        if not got.isdigit():
            return f"the guide ran to {got}"
        i = int(got)
        return (f"block {i} ({self.blocks[i].where}) failed:\n{self.blocks[i].text}\n--- its stdout:\n"
                f"{self.output(i)[-3000:]}\n--- its stderr:\n{self.output(i, 'err')[-3000:]}")

    def stop(self) -> None:
        """End the script and everything it started in the background (its process group)."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            self.proc.poll()   # the script itself, reaped: a zombie leader would keep its group "alive"
            # only zombies left (an orphan's wait for PID 1, late or never on some hosts): done
            if not group_members(self.proc.pid):
                return
            time.sleep(0.2)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
