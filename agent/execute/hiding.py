"""What the jobs mount namespace covers, decided from the agent's configuration
(docs/security.md, "Job isolation").

A cover is a mount in the jobs' namespace, made once, when the namespace is built. A
mount over a *file* is detached by the kernel as soon as that file is unlinked or renamed
over on the host (``sed -i``, configuration management, certificate renewal): the new file
is then uncovered; and a path that does not exist yet cannot be covered at all. A mount
over a *directory* holds whatever later happens inside it: a file made, replaced or
renamed there is on the host's directory, which runs never see. So every secret is hidden
by covering its directory whole, made beforehand when missing; a secret is covered alone
(as a file) only where its directory cannot be covered whole, which the config check
reports, and refuses when a template runs as root: no permission bit keeps a root run
from a file its cover no longer holds.

A directory cannot be covered whole when runs share it: a system directory (``/``,
``/etc``, ``/tmp``, ``/run``, anything directly under ``/``, ``/usr`` or ``/usr/local``…)
or one that a template's command line names (a demo's or a test's directory holding both
the config and the job scripts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional

if TYPE_CHECKING:
    from agent.config import Config

from agent.configcheck import is_root_user

# directories never covered whole (a secret file in them is covered alone)
SHARED_DIRS = frozenset({"/", "/etc", "/var", "/var/lib", "/var/log", "/run", "/tmp", "/var/tmp", "/usr", "/home",
                         "/root", "/srv", "/opt", "/dev", "/proc", "/sys", "/mnt", "/media",
                         "/usr/local", "/var/run", "/var/cache", "/var/spool", "/var/local", "/var/opt",
                         "/var/mail", "/run/lock", "/run/user", "/dev/shm", "/etc/ssl", "/etc/ssl/certs",
                         "/etc/pki", "/etc/pki/tls", "/etc/pki/tls/certs", "/etc/default", "/etc/systemd",
                         "/etc/ca-certificates", "/usr/share/ca-certificates"})
# a directory directly under one of these is shared too (/usr/bin, /usr/local/lib…)
SHARED_PARENTS = frozenset({"/", "/usr", "/usr/local"})


@dataclass
class HidePlan:
    """``dirs``: covered whole (made first when missing); ``files``: covered alone, their
    directory being shared (a replacement by rename is not hidden: ``problems`` says so);
    ``refused``: secrets that cannot be hidden at all (a socket made after start in a
    shared directory), with why."""
    dirs: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    @property
    def hide(self) -> list[str]:
        return sorted(set(self.dirs) | set(self.files))


def shared_dir(path: str, named: Iterable[str] = ()) -> Optional[str]:
    """Why the directory ``path`` cannot be covered whole (None: it can). ``named``: the
    absolute paths templates' command lines name."""
    path = os.path.normpath(path)
    if path in SHARED_DIRS:
        return f"{path} is a system directory runs share"
    if os.path.dirname(path) in SHARED_PARENTS:
        return f"{path} is a system directory runs share"
    for arg in named:
        if arg == path or path.rstrip("/") + "/" in arg:
            return f"{path} holds what a template runs ({arg})"
    return None


def template_paths(cfg: Config) -> list[str]:
    """The command-line words of every template that name a path (contain a ``/``)."""
    return sorted({a for t in cfg.templates.values() for a in t.argv if "/" in a})


def secrets(cfg: Config) -> list[tuple[str, str]]:
    """(config key, absolute path) of every file of the agent no run may read, the admin
    socket included; TLS certificates and CAs are public, their keys are not."""
    out = []
    if cfg.source and not cfg.source.startswith("<"):
        out.append(("config", cfg.source))
    out += [("signing.keys_file", cfg.signing.keys_file), ("audit.key_file", cfg.audit.key_file),
            ("admin.socket", cfg.admin.socket)]
    for name, tls in (("etcd", cfg.etcd.tls), ("mqtt", cfg.mqtt.tls)):
        if tls is not None:
            out += [(f"{name}.tls.{k}", path) for k, path in (("key", tls.key), ("cert", tls.cert)) if path]
    return [(k, os.path.abspath(p)) for k, p in out if p]


def root_templates(cfg: Config) -> list[str]:
    """The templates whose runs are root (uid 0): only they can read a file whatever its mode."""
    return sorted(name for name, t in cfg.templates.items() if t.allow_root and is_root_user(t.user))


def plan(cfg: Config) -> HidePlan:
    """What to cover for the agent's whole configuration ``cfg`` (agent/config.py)."""
    named = template_paths(cfg)
    roots = root_templates(cfg)
    p = HidePlan()
    for key, d in (("state_dir", cfg.state_dir), ("audit.dir", cfg.audit.dir)):
        d = os.path.abspath(d)
        why = shared_dir(d, named)
        if why is None:
            p.dirs.append(d)
        else:
            p.problems.append(f"{key}: {d} is not hidden from runs: {why}; give the agent a directory of its own")
    for key, path in secrets(cfg):
        parent = os.path.dirname(path)
        why = shared_dir(parent, named)
        if key.endswith(".tls.cert"):
            p.files.append(path)   # public (hidden alone, as before): its directory may hold the CAs runs need
        elif why is None:
            p.dirs.append(parent)
        elif key == "admin.socket":
            p.refused.append(f"admin.socket: {path} cannot be hidden from root runs (made after the jobs' namespace, "
                             f"and {why}); put it in a directory of its own (the default: /run/millwright/admin.sock)")
        elif roots:
            p.refused.append(f"{key}: {path} cannot be hidden from root runs (templates {', '.join(roots)}): {why}, "
                             f"so its directory is not covered whole and the file, once replaced by rename or "
                             f"if made after start, is readable to them; move it into a directory of its own "
                             f"(e.g. /etc/millwright) that no template's command line names")
        else:
            p.files.append(path)
            p.problems.append(f"{key}: {path} is hidden from runs as a file only ({why}): once replaced by rename, "
                              f"or if made after start, only its file mode keeps runs out (and a root template "
                              f"added later would stop the agent's start); move it into a directory of its own "
                              f"(e.g. /etc/millwright)")
    p.dirs = sorted(set(p.dirs))
    p.files = sorted(set(p.files) - set(p.dirs))
    return p


def make_dirs(dirs: Iterable[str]) -> None:
    """Each directory to cover, made (0700, root's) when missing: a directory the agent or
    an operator makes after the namespace is built would not be covered."""
    for d in dirs:
        os.makedirs(d, mode=0o700, exist_ok=True)
