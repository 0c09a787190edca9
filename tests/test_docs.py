"""The repository explains itself: every "§n" cited in the code and the README is a section of
docs/architecture.md, and nothing points outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
CITED = re.compile(r"§(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", re.M)


def sections() -> set[str]:
    return set(HEADING.findall(DOC.read_text()))


def citing_files() -> list[Path]:
    return [*sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "benchmarks").rglob("*.py")),
            *sorted((ROOT / "tests").rglob("*.py")), ROOT / "README.md", ROOT / "docs" / "benchmarks.md"]


def test_every_cited_section_exists():
    known = sections()
    assert {"0.4", "3.5", "4.4", "5.3", "6.4.1", "7.2", "8.6", "9.9", "11.5", "13.1"} <= known
    missing = [f"{path.relative_to(ROOT)}: §{n}" for path in citing_files()
               for n in CITED.findall(path.read_text()) if n not in known]
    assert not missing, missing


def test_cited_sections_are_not_a_handful():
    """The check above is not vacuous: the code cites the document throughout."""
    cited = {n for path in citing_files() for n in CITED.findall(path.read_text())}
    assert len(cited) > 50


def test_nothing_points_outside_the_repository():
    hosts = ("pypi.org", "pythonhosted.org", "files.pythonhosted", "shared/", "K3_SPEC", "spec §")
    for path in [*citing_files(), DOC, ROOT / "pyproject.toml", ROOT / "Makefile"]:
        if path == Path(__file__):
            continue
        text = path.read_text()
        found = [h for h in hosts if h in text]
        assert not found, f"{path.relative_to(ROOT)} mentions {found}"


def test_no_unresolved_markers():
    assert "[U]" not in DOC.read_text()
