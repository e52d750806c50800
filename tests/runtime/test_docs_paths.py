"""The docs stay true to the tree: every repository path the README and docs/ name (in backticks or
as a link) exists, every relative link resolves, and the README stays a front door."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# paths a reader is pointed at inside the repository (generated outputs such as data/ and metrics/
# are a run's, not the repository's)
TOP = ("crucible/", "tasks/", "flows/", "tests/", "benchmarks/", "docs/", "profiles/", "requirements/", ".ci/")
FILES = ("params.yaml", "dvc.yaml", "prefect.yaml", "Makefile", "pyproject.toml", "README.md")
TOKEN = re.compile(r"`([^`\s]+)`|\]\(([^)\s#]+)(?:#[^)]*)?\)")


def named_paths(text: str) -> set[str]:
    out = set()
    for code, link in TOKEN.findall(text):
        path = (code or link).rstrip(".,:;")
        if any(c in path for c in "<>{}*$|") or "://" in path:
            continue  # not a literal path: a path template (<task>, {task}, *), or a URL
        if path.startswith(TOP) or path in FILES:
            out.add(path.split("::")[0].split("#")[0])
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_doc_names_exists(doc):
    text = doc.read_text()
    missing = sorted(p for p in named_paths(text) if not (ROOT / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    links = [m for _, m in TOKEN.findall(doc.read_text()) if m and "://" not in m and not m.startswith("mailto:")]
    broken = sorted(link for link in links if not (doc.parent / link).exists())
    assert not broken, f"{doc.relative_to(ROOT)} links to missing files: {broken}"


def test_the_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_the_scanner_finds_paths_and_skips_patterns():
    text = "see `tasks/stages/merge.py`, [the math](docs/methods.md#merge), `data/<task>/x.parquet`, `models/`"
    assert named_paths(text) == {"tasks/stages/merge.py", "docs/methods.md"}
