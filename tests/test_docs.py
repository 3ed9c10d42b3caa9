"""The documentation: the site builds with `mkdocs build --strict` (no broken link, no
undocumented public name: `docs/hooks.py` checks those), and the README stays a front page whose
Python quick start is `examples/quickstart.py`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUICKSTART = ROOT / "examples" / "quickstart.py"


def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_readme_is_a_front_page():
    text = readme()
    assert len(text.splitlines()) <= 200
    # no commit hash or dated run log in prose
    assert not re.search(r"\b[0-9a-f]{7,40}\b", text), re.findall(r"\b[0-9a-f]{7,40}\b", text)
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text)


def test_readme_quick_start_commands_are_make_targets():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    shell = next(b for b in re.findall(r"```bash\n(.*?)```", readme(), re.S) if re.search(r"^make ", b, re.M))
    targets = re.findall(r"^make (\S+)", shell, re.M)
    assert targets[:2] == ["demo", "test"], shell
    for target in targets:
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), target


def test_readme_python_quick_start_is_the_example_file():
    blocks = re.findall(r"```python\n(.*?)```", readme(), re.S)
    assert len(blocks) == 1, "the README has one Python block: the quick start"
    if not QUICKSTART.is_file():
        pytest.skip("examples/quickstart.py (the Python API's quick start) is not on this branch yet")
    assert blocks[0] == QUICKSTART.read_text(encoding="utf-8"), \
        "the README's Python block must be examples/quickstart.py, line for line: copy the file into it"


def test_readme_links_exist():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme()):
        if "://" not in target:
            assert (ROOT / target).exists(), target


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for page in ("reference/cli/index.html", "reference/tables/index.html", "reference/run-layout/index.html",
                 "results/benchmarks/index.html", "results/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "--negation" in cli and "--min-cell" in cli  # generated from the parser
    tables = (tmp_path / "site" / "reference" / "tables" / "index.html").read_text(encoding="utf-8")
    assert "gate_verdicts" in tables and "causal_bound" in tables  # generated from the registry
    results = (tmp_path / "site" / "results" / "index.html").read_text(encoding="utf-8")
    assert "<!-- results:" not in results  # every results file was included


def test_readme_findings_table_is_the_recorded_one():
    """The README's table of what the demo finds is `benchmarks/results/demo_findings.md`'s,
    written by `benchmarks/demo_findings.py` from a finished run, never typed by hand."""
    recorded = (ROOT / "benchmarks" / "results" / "demo_findings.md").read_text(encoding="utf-8")
    table = [line for line in recorded.splitlines() if line.startswith("|")]
    section = readme().split("## What the demo finds", 1)[1].split("\n## ", 1)[0]
    assert table and [line for line in section.splitlines() if line.startswith("|")] == table
