"""A job's view within a byte bound, whatever etcd holds.

Views are built from etcd (agent/jobs/view.py), which an etcd writer can fill with anything:
a 1 MB ``_accepted``, a run record with a huge ``reason``, thousands of waiting marks or
rollout keys. Every answer made of views (``jobs/get`` by id and its pages,
`millwright jobs show`) goes through :func:`fitted`, so its size never depends on what etcd
holds:

- a string that must be cut keeps a prefix of at most :data:`STRING_KEEP` bytes and ends
  with ``…[truncated: N bytes]`` (N: the whole string's UTF-8 size), so its type stays;
- an object, array or number that cannot be brought within its share by cutting its parts
  becomes the marker ``{"truncated": true, "bytes": N}`` (N: its JSON size);
- the view names what was cut in ``"cut"`` (at most :data:`MAX_PATHS` dotted paths, e.g.
  ``"accepted"``, ``"runs.0.reason"``);
- a view that cannot fit even so becomes a stub: ``{"id", "shard", "truncated": true,
  "bytes": N}`` (the id from the etcd key, never from the stored document).

Largest parts are cut first, each just enough (never below :data:`MIN_SHARE` bytes), so one
oversized field costs that field, not the rest of the view. Sizes are those of
:func:`encode`, the encoding the publisher sends.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

STRING_KEEP = 1024      # bytes of a cut string kept at most (less when its share is smaller)
MIN_SHARE = 64          # a part is never cut below this many bytes for the others' sake
MAX_DEPTH = 24          # deeper parts are cut whole (a forged document may nest deeply)
MAX_PARTS = 256         # an object or array of more parts that must be cut is cut whole
MAX_PATHS = 8           # paths named in "cut"
PATH_CHARS = 96         # characters of one path at most
KEY_CHARS = 32          # characters of one key in a path at most
CUT_RESERVE = 1024      # bytes kept for the "cut" list while cutting (a quarter of a small bound)


def encode(doc: Any) -> bytes:
    """``doc`` as the publisher sends it: compact JSON, UTF-8; a lone surrogate (which a
    forged document may hold) becomes ``?`` instead of failing the answer."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, default=str).encode("utf-8", "replace")


def size(doc: Any) -> int:
    return len(encode(doc))


def marker(nbytes: int) -> dict:
    return {"truncated": True, "bytes": nbytes}


def stub(job_id: Any, shard: Any, nbytes: int) -> dict:
    """What is left of a view that cannot fit: which job, and that it was cut."""
    return {"id": job_id, "shard": shard, **marker(nbytes)}


_CUT = re.compile(r"…\[truncated: (\d+) bytes\]\Z")


def _cut_string(text: str, limit: int) -> Any:
    done = _CUT.search(text)
    if done is not None:   # cut by a first pass already: its suffix keeps the original size
        text, suffix = text[:done.start()], done.group(0)
    else:
        suffix = f"…[truncated: {len(text.encode('utf-8', 'replace'))} bytes]"
    room = min(limit, STRING_KEEP + size(suffix))
    if size(suffix) > room:
        return marker(size(text))
    # each character encodes to at least one byte: the prefix has at most ``room`` characters
    lo, hi = 0, min(len(text), room)
    while lo < hi:   # the longest prefix whose cut string fits ``room``
        mid = (lo + hi + 1) // 2
        if size(text[:mid] + suffix) <= room:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo] + suffix


def _path(parts: list) -> str:
    text = ".".join(p if len(p) <= KEY_CHARS else p[:KEY_CHARS - 1] + "…" for p in map(str, parts)) or "."
    return text if len(text) <= PATH_CHARS else text[:PATH_CHARS - 1] + "…"


def shrink(value: Any, limit: int, path: Optional[list] = None, depth: int = 0,
           known: Optional[int] = None) -> tuple[Any, list[str]]:
    """``value`` within ``limit`` bytes when it can be (a marker always fits 64 bytes), and
    the paths of what was cut. Invariant: the size of the result never exceeds the size of
    ``value``; a part is replaced only by something smaller. ``known``: ``value``'s size,
    when the caller measured it."""
    path = path or []
    whole = size(value) if known is None else known
    if whole <= limit:
        return value, []
    if isinstance(value, str):
        return _cut_string(value, limit), [_path(path)]
    if depth >= MAX_DEPTH or not isinstance(value, (dict, list)) or not value or len(value) > MAX_PARTS:
        # too deep, not cuttable, or so many parts that measuring each would cost more than
        # the answer is worth (a forged object of 100,000 keys): cut whole
        return marker(whole), [_path(path)]
    keys = list(value) if isinstance(value, dict) else list(range(len(value)))
    out: Any = dict(value) if isinstance(value, dict) else list(value)
    total = whole
    cuts: dict[Any, list[str]] = {}
    # a first pass leaves each cut part a fair share, so one oversized field costs that
    # field alone; a second cuts parts down to MIN_SHARE when the first was not enough
    for floor in (min(limit // 4, 2 * STRING_KEEP), MIN_SHARE):
        parts = sorted(((size(out[k]), i, k) for i, k in enumerate(keys)), reverse=True)
        for sz, _, k in parts:
            if total <= limit or sz <= max(floor, MIN_SHARE):
                break   # fits; or only small parts are left, which a marker would not shrink
            new, paths = shrink(out[k], max(sz - (total - limit), floor), path + [k], depth + 1, sz)
            nsz = size(new)
            if nsz < sz:
                # compact JSON is compositional: the whole changes by the part's change exactly
                out[k], total = new, total - sz + nsz
                old = [p for p in cuts.get(k, []) if p not in paths and not any(p.startswith(n + ".") for n in paths)]
                cuts[k] = old + paths   # a part cut whole covers what was cut inside it
        if total <= limit:
            return out, [p for k in keys if k in cuts for p in cuts[k]]
    return marker(whole), [_path(path)]   # many small parts, or keys too large: cut whole


def fitted(view: dict, max_bytes: int, job_id: Any = None, shard: Any = None) -> dict:
    """``view`` within ``max_bytes`` of :func:`encode`: unchanged when it fits; else its
    largest parts cut (named in ``cut``); else a :func:`stub` (``job_id`` and ``shard``
    from the etcd key; the view's own when not given). The result's size is at most
    ``max_bytes`` whenever the stub fits (an id of 128 characters: under 256 bytes)."""
    whole = size(view)
    if whole <= max_bytes:
        return view
    base = {k: v for k, v in view.items() if k != "cut"}
    out, cuts = shrink(base, max(max_bytes - min(CUT_RESERVE, max_bytes // 4), MIN_SHARE),
                       known=whole if "cut" not in view else None)
    if isinstance(out, dict) and out.get("truncated") is not True:
        for n in range(min(len(cuts), MAX_PATHS), -1, -1):   # fewer paths named when they do not fit
            named = cuts[:n] + ([f"…and {len(cuts) - n} more"] if len(cuts) > n else [])
            if size(out) + size(named) + len(',"cut":') <= max_bytes:
                return dict(out, cut=named)
    return stub(view.get("id") if job_id is None else job_id, view.get("shard") if shard is None else shard,
                whole)


def was_cut(view: Any) -> Optional[str]:
    """``"stub"`` or ``"cut"`` when :func:`fitted` had to cut ``view``, else None."""
    if not isinstance(view, dict):
        return None
    if view.get("truncated") is True:
        return "stub"
    return "cut" if "cut" in view else None
