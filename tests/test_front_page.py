"""The README is the product's front page: short, its two set-up commands the ones CI runs
and a new user types, and every file it links to exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
INSTALL_AND_RUN = "pip install -c constraints-cpu.txt -e . && ring-pipeline run recipes/tiny.yaml"
INSTALL_AND_TEST = "pip install -q -c constraints-cpu.txt -e '.[dev]' && python -m pytest -q"


def test_the_readme_is_at_most_250_lines():
    assert len(README.splitlines()) <= 250


def test_the_two_set_up_commands_are_the_ones_ci_and_users_run():
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    assert [INSTALL_AND_RUN + "\n", INSTALL_AND_TEST + "\n"] == blocks[:2]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == INSTALL_AND_TEST  # CI runs the README's test command, verbatim


def test_every_relative_link_of_the_readme_and_docs_exists():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_nothing_a_user_reads_points_at_the_developers_shared_folder():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "recipes").rglob("*.yaml"))]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in pages
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if "../shared" in line]
    assert hits == []
