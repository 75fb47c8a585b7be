#!/usr/bin/env python3
"""Rewrite the configuration reference in docs/configuration.md from agent/config.py (`make reference`)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from agent.config import reference_markdown  # noqa: E402

START, END = "<!-- reference:start -->", "<!-- reference:end -->"
path = os.path.join(ROOT, "docs", "configuration.md")
text = open(path, encoding="utf-8").read()
head, rest = text.split(START, 1)
_, tail = rest.split(END, 1)
open(path, "w", encoding="utf-8").write(head + START + "\n" + reference_markdown() + END + tail)
