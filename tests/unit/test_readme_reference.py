"""The README's configuration reference is generated from the config dataclasses."""

import os

from agent.config import reference_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_readme_reference_matches_the_code():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("<!-- reference:start -->\n", 1)[1].split("<!-- reference:end -->", 1)[0]
    assert section == reference_markdown(), "run `make reference` to regenerate the README table"


def test_readme_starts_with_the_two_commands():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    head = text[:400]
    assert "make demo" in head and "make test" in head
