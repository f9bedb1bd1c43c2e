"""The README is a reference and the generated pages follow the code.

docs/cli.md and docs/config.md are what ``python -m k3sched.docgen`` gives today ([Note: generated
reference] in k3sched/docgen.py); the README stays short (at most 300 lines of at most 200
characters) and names no commit; every relative link of README.md and docs/*.md names a file of
the repository.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from k3sched import docgen

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")  # a letter and a digit: no word, no number


@pytest.mark.parametrize("page", [docgen.CLI_MD, docgen.CONFIG_MD], ids=lambda p: p.name)
def test_generated_page_is_current(page):
    text = docgen.pages()[page]
    assert page.is_file(), f"{page.relative_to(ROOT)} is missing; run `make docs`"
    assert page.read_text(encoding="utf-8") == text, f"{page.relative_to(ROOT)} is out of date; run `make docs`"


def test_generated_pages_name_every_command_and_field():
    import typer.main

    from k3sched.cli import app
    from k3sched.config import Config

    cli = docgen.cli_markdown()
    for name in typer.main.get_command(app).commands:
        assert f"## `k3sched {name}`" in cli
    conf = docgen.config_markdown()
    for section, field in Config.model_fields.items():
        for name in field.annotation.model_fields:
            assert f"| `{name}` |" in conf, f"{section}.{name}"


def test_check_names_a_stale_page(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "cli.md"
    stale.write_text("old\n")
    monkeypatch.setattr(docgen, "CLI_MD", stale)
    monkeypatch.setattr(docgen, "ROOT", tmp_path)
    monkeypatch.setattr(docgen, "CONFIG_MD", tmp_path / "config.md")
    (tmp_path / "config.md").write_text(docgen.config_markdown())
    assert docgen.main(["--check"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cli.md is out of date" in err[0]


def test_an_undocumented_field_is_refused(monkeypatch):
    monkeypatch.setattr(docgen, "attribute_docs", lambda cls: {})
    with pytest.raises(ValueError, match="no docstring for"):
        docgen.config_markdown()


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; at most 300"
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 200]
    assert not long, f"README.md lines over 200 characters: {long}"


def test_readme_names_no_commit():
    found = HASH.findall(README.read_text(encoding="utf-8"))
    assert not found, f"README.md names commit-like hashes: {found}"


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold no links
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor of the page itself
        path = unquote(target.split("#", 1)[0])
        if not (page.parent / path).resolve().exists():
            bad.append(target)
    assert not bad, f"{page.relative_to(ROOT)}: links to no file: {bad}"
