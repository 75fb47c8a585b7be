"""Removing a directory tree without recursion, descriptors bounded, links never followed,
mount points never crossed: the cleaner's walk (agent/execute/cleanup.py).

Standard library only, and runnable as a script: the cleaner runs it in a helper process
(``python3 -I -S rmtree.py DIR BUDGET NAME CAP ...``, one JSON line per tree on stdout), so the
walk over hundreds of thousands of entries never competes for the agent's interpreter lock
with the thread that ends runs, and a walk stuck in the kernel can be killed.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
from typing import NamedTuple, Optional

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# how often a long walk looks at its stop flag (removals between two looks)
_STOP_EVERY = 1024


class Progress(NamedTuple):
    """One call of remove_tree: ``done`` (the tree is gone), entries it removed, and why it
    stopped early (None: the budget or the stop flag; else the error that blocks it)."""
    done: bool
    removed: int
    error: Optional[str]


class _Refused(Exception):
    """An entry the walk must not go into or cannot remove: the tree stays (for now)."""


def _why(exc: OSError, what: str) -> str:
    return f"{what}: {exc.strerror or exc}"


def open_dir(parent: int, name: str, dev: int) -> tuple[int, os.stat_result]:
    """``name`` in ``parent`` as a directory descriptor, refused if it is a symbolic link
    (O_NOFOLLOW: ELOOP/ENOTDIR) or on another device (a mount point)."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        raise _Refused(_why(exc, f"open {name!r}")) from None
    st = os.fstat(fd)
    if st.st_dev != dev:
        os.close(fd)
        raise _Refused(f"{name!r} is a mount point (not crossed)")
    return fd, st


def remove_tree(parent: int, name: str, budget: int, stop: Optional[threading.Event] = None) -> Progress:
    """Remove ``name`` in the directory ``parent`` (a descriptor) and all below it, at most
    ``budget`` removals; call again to go on (what is gone stays gone). No recursion: the
    walk's state is the list of names from ``name`` down to the directory it holds."""
    dev = os.fstat(parent).st_dev
    try:
        os.unlink(name, dir_fd=parent)   # a file or a symbolic link: one call
        return Progress(True, 1, None)
    except FileNotFoundError:
        return Progress(True, 0, None)
    except IsADirectoryError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.EISDIR, errno.EPERM):   # EPERM: unlink of a directory (POSIX)
            return Progress(False, 0, _why(exc, f"unlink {name!r}"))
    removed = 0
    try:
        cur, st = open_dir(parent, name, dev)
    except _Refused as exc:
        return Progress(False, 0, str(exc))
    # (name, inode) from the top down to the directory `cur` holds; its length is the depth
    path: list[tuple[str, int]] = [(name, st.st_ino)]
    try:
        while True:
            child = None
            with os.scandir(cur) as it:   # a dup of cur, closed with the iterator
                for de in it:
                    if removed >= budget or (stop is not None and removed % _STOP_EVERY == 0 and stop.is_set()):
                        return Progress(False, removed, None)
                    try:
                        is_dir = de.is_dir(follow_symlinks=False)
                    except OSError:
                        is_dir = False
                    if not is_dir:
                        try:
                            os.unlink(de.name, dir_fd=cur)
                            removed += 1
                            continue
                        except FileNotFoundError:
                            continue
                        except IsADirectoryError:
                            pass   # d_type said otherwise: it is a directory after all
                        except OSError as exc:
                            return Progress(False, removed, _why(exc, f"unlink {de.name!r}"))
                    child = de.name
                    break
            if child is not None:   # go down: hold the child, let go of this one
                try:
                    fd, cst = open_dir(cur, child, dev)
                except _Refused as exc:
                    return Progress(False, removed, str(exc))
                os.close(cur)
                cur = fd
                path.append((child, cst.st_ino))
                continue
            # `cur` is empty: remove it from its parent and go on with the parent
            if removed >= budget:
                return Progress(False, removed, None)
            if len(path) == 1:
                os.close(cur)
                cur = -1
                try:
                    os.rmdir(name, dir_fd=parent)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    return Progress(False, removed, _why(exc, f"rmdir {name!r}"))
                return Progress(True, removed + 1, None)
            try:
                up = os.open("..", DIR_FLAGS, dir_fd=cur)
            except OSError as exc:
                return Progress(False, removed, _why(exc, "open .."))
            ust = os.fstat(up)
            if (ust.st_dev, ust.st_ino) != (dev, path[-2][1]):   # moved meanwhile: not where we came from
                os.close(up)
                return Progress(False, removed, f"{path[-1][0]!r} moved during the walk")
            os.close(cur)
            cur = up
            gone = path.pop()[0]
            try:
                os.rmdir(gone, dir_fd=cur)
                removed += 1
            except OSError as exc:
                return Progress(False, removed, _why(exc, f"rmdir {gone!r}"))
    except OSError as exc:   # scandir/fstat of a held directory (EMFILE, EIO, ...)
        return Progress(False, removed, _why(exc, "walk"))
    finally:
        if cur >= 0:
            os.close(cur)


def main(argv: list[str]) -> int:
    """DIR BUDGET (NAME CAP)...: one JSON line per tree worked on, as it is done with it;
    at most BUDGET removals in all, CAP in a tree."""
    try:
        os.nice(10)   # the agent's runs first
    except OSError:
        pass
    parent = os.open(argv[0], DIR_FLAGS)
    budget = int(argv[1])
    for name, cap in zip(argv[2::2], argv[3::2]):
        if budget <= 0:
            break
        p = remove_tree(parent, name, min(budget, int(cap)))
        budget -= p.removed
        sys.stdout.write(json.dumps({"name": name, "done": p.done, "removed": p.removed, "error": p.error}) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
