"""The code says what it keeps and why: no dates, no commit references and no pointers to files
outside the repository in the packages' sources (measurements and history belong in
docs/results.md and the git log, not in comments)."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT

PACKAGES = ("k3sched", "runtime", "moe", "offload", "traces")

DATE = re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")
"""An ISO date (2026-12-04)."""

_HEX = r"(?!\d+e\d+\b)(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}"  # not a float like 1e100000
COMMIT = re.compile(
    r"\b(?:since|commit|commits|in|at|of|from|see|before|after|until|reverts?|reverted)\s+" + _HEX + r"\b"
    r"|\(" + _HEX + r"\)",
    re.IGNORECASE)
"""A commit hash used as a reference: 7-40 hex digits with a digit and a letter, after a word such
as "since" or "of", or alone in parentheses ("since cbfc571", "(c4e77b6)")."""

OUTSIDE = re.compile(r"DESIGN\.md|STYLE\.md|\.\./shared")
"""Files that are not in the repository (the design document is docs/design.md)."""

RULES = {"date": DATE, "commit reference": COMMIT, "file outside the repository": OUTSIDE}


def _sources() -> list:
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    assert len(files) > 50, files  # the packages are where the tests expect them
    return files


@pytest.mark.parametrize("rule", sorted(RULES))
def test_sources_hold_none(rule):
    pat = RULES[rule]
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
            for p in _sources()
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if pat.search(line)]
    assert not hits, f"{rule} in the code:\n" + "\n".join(hits)


@pytest.mark.parametrize("text, rule", [
    ("replayed exact until 2026-12-04; but", "date"),
    ("the second full bench of c4e77b6). With", "commit reference"),
    ("# kept since cbfc571", "commit reference"),
    ("as measured (c4e77b6)", "commit reference"),
    ("see Commit 0a1b2c3d4e5f for why", "commit reference"),
    ("(DESIGN.md section 3)", "file outside the repository"),
    ("(STYLE.md point 4)", "file outside the repository"),
    ("from ../shared/traces/real", "file outside the repository"),
])
def test_rules_catch(text, rule):
    assert RULES[rule].search(text)


@pytest.mark.parametrize("text", [
    "key = (cfg.parallel.ep * 1000003 + cfg.parallel.redundant_experts)",  # digits only
    "r.start < 9007199254740992000",
    "h = 0x9e3779b97f4a7c15",  # a hex constant, not a reference
    "x = 1e1000000",
    "a limit (1e100000) in parentheses",
    "docs/design.md, section 3",
    "an 8-expert profile (0..16)",
    "decade 2026-13-40 is no date",
])
def test_rules_pass(text):
    assert not any(pat.search(text) for pat in RULES.values()), text
