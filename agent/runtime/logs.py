"""Structured logging: one line per event, key=value fields an operator can grep.

Use ``log.info("message", extra={"fields": {...}})``. Set MILLWRIGHT_LOG_JSON=1 for JSON
lines (for journald/ELK).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time


class _Formatter(logging.Formatter):
    def __init__(self, as_json: bool, agent_id: str):
        super().__init__()
        self.as_json = as_json
        self.agent_id = agent_id

    def format(self, record: logging.LogRecord) -> str:
        fields = dict(getattr(record, "fields", {}) or {})
        if self.as_json:
            doc = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                   "agent": self.agent_id, "msg": record.getMessage(), **fields}
            if record.exc_info:
                doc["exc"] = self.formatException(record.exc_info)
            return json.dumps(doc, default=str)
        ts = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        kv = " ".join(f"{k}={_q(v)}" for k, v in fields.items())
        line = f"{ts} {record.levelname[0]} [{self.agent_id}] {record.name.removeprefix('agent.')}: {record.getMessage()}"
        if kv:
            line += " " + kv
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _q(v: object) -> str:
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' ="')) else s


def setup(agent_id: str = "-", level: str | None = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(os.environ.get("MILLWRIGHT_LOG_JSON") == "1", agent_id))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level or os.environ.get("MILLWRIGHT_LOG_LEVEL", "INFO"))
    # grpc and paho are noisy at DEBUG; their failures surface through our own lines
    for noisy in ("grpc", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
