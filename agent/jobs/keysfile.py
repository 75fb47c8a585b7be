"""The agents' keys file (``signing.keys_file``): adding a public entry to it.

The file the agent loads must be a regular file that group and others cannot access and,
when the agent runs as root, root's (``KeyRing.load``): whoever can write it decides which
signatures make jobs run. ``add_public_entry`` leaves a file the agent accepts: it creates
a missing one with mode 0600 (so owned by whoever runs it: root for an agent run as root),
and appends to an existing one only when that one loads as a keys file already and does
not hold the key id yet (a key id names one key for ever: a second entry would replace the
first one's meaning for documents already signed).
"""

from __future__ import annotations

import os

import yaml

from agent.jobs.signing import KeyFileError, KeyRing


class KeysFileError(Exception):
    """The keys file cannot take the entry; the message says why and what to do."""


def check_can_add(path: str, kid: str) -> None:
    """Raise KeysFileError when ``path`` exists and is not a keys file the agent would load,
    or already holds ``kid``. Called before a key pair is made, so a refusal leaves nothing."""
    if not os.path.lexists(path):
        return
    try:
        ring = KeyRing.load(path, require_private=False)
    except KeyFileError as exc:
        raise KeysFileError(exc.problems[0]) from None
    if ring.get(kid) is not None:
        raise KeysFileError(f"{path}: already holds key id {kid}; a key id names one key (choose another --kid)")


def add_public_entry(path: str, kid: str, entry: str) -> bool:
    """Append ``entry`` (the YAML of ``{kid: {alg, public_key}}``) to the keys file at
    ``path``, creating it with mode 0600 when missing. True when the file was created."""
    check_can_add(path, kid)
    parsed = yaml.safe_load(entry)
    if not isinstance(parsed, dict) or list(parsed) != [kid]:
        raise ValueError(f"entry must be one mapping for key id {kid}")
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    created = not os.path.lexists(path)
    fd = os.open(path, flags | (os.O_EXCL if created else 0), 0o600)
    try:
        if created:
            os.fchmod(fd, 0o600)   # whatever the umask
        elif os.fstat(fd).st_size > 0 and not _ends_with_newline(path):
            entry = "\n" + entry
        data = entry.encode("utf-8")
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return created


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"
