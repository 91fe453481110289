"""The README and docs/ link only to files inside the repository, and every such file exists."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_and_docs_link_only_to_files_in_the_repository():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert len(pages) >= 5
    broken = []
    for page in pages:
        text = page.read_text()
        assert "../shared" not in text, page
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#")[0]
            if not path:
                continue  # an anchor on the same page
            assert "://" not in path, f"{page.name}: {target} is not a file of the repository"
            resolved = (page.parent / path).resolve()
            if not (resolved.is_relative_to(REPO) and resolved.exists()):
                broken.append(f"{page.name}: {target}")
    assert not broken, broken


def test_the_paper_report_is_what_the_committed_summaries_give():
    """results/paper/ is written by tools/paper_report.py from results/**/summary.json: a summary re-measured
    without re-running the report (or a report edited by hand) fails here."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "tools/paper_report.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
