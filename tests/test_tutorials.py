"""The tutorial notebooks and the quick-start script, run on the small demo's run as a reader
would run them (from a folder holding `results/demo`): their own assert cells check the
results against the run's tables and the `graph` command's scores."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.children import child_env

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "docs" / "tutorials"
pytestmark = pytest.mark.slow


@pytest.fixture()
def reader(small_demo, tmp_path) -> Path:
    """A working folder with the demo's run at `results/demo`, as after `bilinear-circuits demo`."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "demo").symlink_to(small_demo, target_is_directory=True)
    return tmp_path


def _execute(name: str, folder: Path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(TUTORIALS / name, as_version=4)
    env = child_env()
    client = nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(folder)}})
    with _environment(env):
        client.execute()
    return notebook


class _environment:
    """The kernel inherits this process's environment: set it for the kernel's start."""

    def __init__(self, env: dict):
        self.env, self.saved = env, None

    def __enter__(self):
        self.saved = dict(os.environ)
        os.environ.update(self.env)

    def __exit__(self, *exc):
        os.environ.clear()
        os.environ.update(self.saved)


def _printed(notebook) -> str:
    return "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
                   if o.get("output_type") == "stream")


def test_the_tutorials_are_stored_without_outputs():
    names = sorted(p.name for p in TUTORIALS.glob("*.ipynb"))
    assert names == ["own-model.ipynb", "quickstart.ipynb"]
    for name in names:
        cells = json.loads((TUTORIALS / name).read_text())["cells"]
        code = [c for c in cells if c["cell_type"] == "code"]
        assert code and all(not c["outputs"] and c["execution_count"] is None for c in code), name
        last = code[-1]["source"]
        assert "assert " in (last if isinstance(last, str) else "".join(last)), f"{name} ends without its checks"


def test_quickstart_notebook_runs_and_its_checks_pass(reader):
    notebook = _execute("quickstart.ipynb", reader)
    assert re.search(r"rank-2 correlation -?\d\.\d+ \| completeness \d\.\d+", _printed(notebook))


def test_own_model_notebook_runs_and_its_checks_pass(tmp_path):
    from tests.real_text import kjv_file, vader_lexicon_file

    kjv_file(), vader_lexicon_file()  # skip, saying why, without the packages that ship the texts
    notebook = _execute("own-model.ipynb", tmp_path)
    assert re.search(r"rank-2 correlation -?\d\.\d+ \| completeness \d\.\d+", _printed(notebook))
    assert (tmp_path / "own-model" / "run" / "tables" / "interactions" / "layer1").is_dir()


def test_quickstart_script_prints_interactions_spectrum_and_a_path(reader):
    script = ROOT / "examples" / "quickstart.py"
    lines = [line for line in script.read_text().splitlines() if line.strip()]
    assert len(lines) <= 10  # the README's Python quick start is these lines
    done = subprocess.run([sys.executable, str(script)], cwd=reader, env=child_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert re.search(r"^Feature\(layer=\d, feature=\d+, description=", out, re.M)
    assert re.search(r"^\s+kind\s+in_a\s", out, re.M) and len(re.findall(r"^\d\s+(cross|self)\s", out, re.M)) == 5
    spectrum = re.search(r"^spectrum: \[(.*)\]$", out, re.M)
    assert spectrum and len(spectrum.group(1).split()) == 6
    assert re.search(r"^Graph\('Lily was sad. She was not': \d+ nodes", out, re.M)
    path = out.strip().splitlines()[-1].split(" -> ")
    assert path[0].startswith("Emb: ") and path[-1].startswith("Output ")
