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


def _note_name(text: str) -> str:
    """A note's name as cited, a line break inside it (and a comment's ``#``) folded to one space."""
    return re.sub(r"\s*\n[\s#]*", " ", text).strip()


NOTE_DEF = re.compile(r'^[ \t#"]*\[Note: ([^\]]+)\]', re.M)
NOTE_CITE = re.compile(r"\[Note: ([^\]]+)\]`? in [`:]*(?:func:`[^`]*`\s*\()?`?([A-Za-z0-9_/.]+\.(?:py|md))")


def _notes(files: dict[str, str]) -> tuple[dict[str, set[str]], list[str]]:
    """(note name -> files that define it, problems): a note is defined where ``[Note: NAME]``
    begins a line; every ``[Note: NAME]`` must be defined somewhere, and one cited as
    ``[Note: NAME] in FILE`` must be defined in FILE (a bare file name is beside the citing file)."""
    defs: dict[str, set[str]] = {}
    for f, text in files.items():
        for m in NOTE_DEF.finditer(text):
            defs.setdefault(_note_name(m.group(1)), set()).add(f)
    bad = []
    for f, text in files.items():
        for m in re.finditer(r"\[Note: ([^\]]+)\]", text):
            name = _note_name(m.group(1))
            if name != "..." and name not in defs:
                bad.append(f"{f}: [Note: {name}] is defined nowhere")
        for m in NOTE_CITE.finditer(text):
            name, path = _note_name(m.group(1)), m.group(2)
            path = path if "/" in path else f"{f.rpartition('/')[0]}/{path}".lstrip("/")
            if name in defs and path not in defs[name]:
                bad.append(f"{f}: [Note: {name}] cited in {path}, defined in {', '.join(sorted(defs[name]))}")
    return defs, bad


def test_every_cited_note_is_where_it_is_cited():
    """``[Note: NAME] in FILE`` sends a reader to FILE: the note must be there (notes move with the
    code they explain, and the citations with them)."""
    files = {p.relative_to(ROOT).as_posix(): p.read_text()
             for d in (*PACKAGES, "tests", "docs", "benchmarks", "scripts") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".md") and "__pycache__" not in p.parts and p.name != "test_code_hygiene.py"}
    files["README.md"] = (ROOT / "README.md").read_text()
    defs, bad = _notes(files)
    assert len(defs) > 50  # the scan finds the notes
    assert not bad, "\n".join(bad)


def test_a_note_cited_in_the_wrong_file_is_caught():
    files = {"a/x.py": "# [Note: kept]\n# the rule\n", "a/y.py": "see [Note: kept] in a/y.py; [Note: gone]\n",
             "a/z.py": "see [Note: kept] in x.py"}
    _, bad = _notes(files)
    assert bad == ["a/y.py: [Note: gone] is defined nowhere", "a/y.py: [Note: kept] cited in a/y.py, defined in a/x.py"]
