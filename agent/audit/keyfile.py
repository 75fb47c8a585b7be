"""The audit HMAC key: a root-only file, created on the writer's first start.

The file holds 32 random bytes as 64 hex characters (any longer hex string, or at least
32 raw bytes, is accepted too, so an operator may provision the key from a vault). A key
file that group or others may read or write is refused: anyone who can read the key can
forge records that verify.
"""

from __future__ import annotations

import os
import re
import secrets
import stat

_HEX_RE = re.compile(rb"^(?:[0-9a-fA-F]{2}){32,}$")


class KeyFileError(Exception):
    """A key file problem, as one line for the operator."""


def load_key(path: str, create: bool = False) -> bytes:
    """Read the key; with ``create`` make a new one (mode 0600) when the file is missing."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if not create:
            raise KeyFileError(f"audit key file {path} does not exist") from None
        return _create(path)
    except OSError as exc:
        raise KeyFileError(f"cannot access audit key file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"audit key file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise KeyFileError(
            f"audit key file {path} is accessible by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"it must be root-only: chmod 600 {path}"
        )
    if st.st_uid not in (0, os.geteuid()):
        raise KeyFileError(f"audit key file {path} is owned by uid {st.st_uid}, not by root")
    try:
        with open(path, "rb") as fh:
            data = fh.read(4096).strip()
    except PermissionError:
        raise KeyFileError(f"cannot read audit key file {path}: permission denied (run as root)") from None
    except OSError as exc:
        raise KeyFileError(f"cannot read audit key file {path}: {exc.strerror}") from None
    if _HEX_RE.match(data):
        return bytes.fromhex(data.decode("ascii"))
    if len(data) < 32:
        raise KeyFileError(f"audit key file {path} holds {len(data)} bytes; a key needs at least 32 (64 hex characters)")
    return data


def _create(path: str) -> bytes:
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise KeyFileError(f"cannot create directory {parent} for the audit key: {exc.strerror}") from None
    key = secrets.token_bytes(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process created it meanwhile: use theirs
        return load_key(path, create=False)
    except OSError as exc:
        raise KeyFileError(f"cannot create audit key file {path}: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o600)  # in case of an unusual umask
        os.write(fd, key.hex().encode("ascii") + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    return key
