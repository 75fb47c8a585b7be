"""The documentation's promises that code can check: the README's shape, links that lead
somewhere, and the configuration reference generated from the config dataclasses."""

import os
import re

from agent.config import reference_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README_MAX_LINES = 250
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
FENCE_RE = re.compile(r"^```.*?^```", re.S | re.M)


def _read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
        return fh.read()


def _markdown_files():
    docs = sorted("docs/" + n for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    return ["README.md", "CHANGELOG.md"] + docs


def _anchors(text):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, a
    repeated heading numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE_RE.sub("", text).splitlines():
        m = re.match(r"#{1,6} +(.*?) *#* *$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(rel):
    """(target file relative to ROOT, anchor or None) of every relative Markdown link."""
    text = FENCE_RE.sub("", _read(rel))
    for target in LINK_RE.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = rel if not path else os.path.normpath(os.path.join(os.path.dirname(rel), path))
        yield target, resolved, anchor or None


def test_configuration_reference_matches_the_code():
    text = _read("docs/configuration.md")
    section = text.split("<!-- reference:start -->\n", 1)[1].split("<!-- reference:end -->", 1)[0]
    assert section == reference_markdown(), "run `make reference` to regenerate docs/configuration.md"


def test_readme_starts_with_the_two_commands():
    head = _read("README.md")[:400]
    assert "make demo" in head and "make test" in head


def test_readme_stays_short():
    lines = _read("README.md").count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_every_document_is_reachable_from_the_readme():
    linked = {resolved for _, resolved, _ in _links("README.md")}
    missing = [f for f in _markdown_files()[1:] if f not in linked]
    assert not missing, f"not linked from README.md: {missing}"


def test_links_between_documents_lead_somewhere():
    bad = []
    for rel in _markdown_files():
        for target, resolved, anchor in _links(rel):
            if not resolved.endswith(".md"):
                continue  # code and config files: not shipped with the docs everywhere the tests run
            if not os.path.exists(os.path.join(ROOT, resolved)):
                bad.append(f"{rel}: {target}: no such file")
            elif anchor and anchor not in _anchors(_read(resolved)):
                bad.append(f"{rel}: {target}: no heading with anchor #{anchor} in {resolved}")
    assert not bad, "\n".join(bad)
