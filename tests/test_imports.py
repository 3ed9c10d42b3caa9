"""What imports what: the report and the explorer stand apart from the stages, a command
without --ray never loads Ray, and `circuits` is tensor math without tables, progress bars or
thread pools."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = ROOT / "pipelines"
APART = ("report", "explorer")  # they read a run's files; they must not pull in the code that writes them
CIRCUITS = ROOT / "circuits"
# tables, progress and threads belong in pipelines/ (docs/index.md, "Layout of the code")
NOT_IN_CIRCUITS = ("pandas", "tqdm", "concurrent.futures", "threading", "multiprocessing")


def _module(path: Path) -> str:
    """Dotted name of a source file under the repository root."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, at any depth (inside functions too), with
    relative imports resolved and `from X import Y` also giving X.Y (Y may be a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            found.append((node.lineno, node.args[0].value))
    return found


def test_the_report_and_the_explorer_never_import_the_stages():
    files = [f for part in APART for f in sorted((PIPELINES / part).rglob("*.py"))]
    assert len(files) >= 4  # the folders were found: an empty scan would pass on nothing
    offending = [f"{f.relative_to(ROOT)}:{line} imports {name}" for f in files for line, name in _imported(f)
                 if name == "pipelines.stages" or name.startswith("pipelines.stages.")]
    assert not offending, "\n".join(offending)


def test_loading_the_report_and_the_explorer_loads_no_stages():
    # the parse above sees only their own files: this catches the stages arriving through a module they import
    modules = sorted(_module(f) for part in APART for f in (PIPELINES / part).rglob("*.py"))
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "assert 'pipelines.stages' not in sys.modules, 'loaded pipelines.stages'\n")
    _python(code)


def test_the_parser_and_every_module_of_a_command_without_ray_load_no_ray(tmp_path):
    # every module of the package (pipelines.engine.cluster included: it imports Ray only when --ray asks),
    # found by file as some folders are namespace packages that pkgutil does not walk; __main__ would run the CLI
    modules = sorted(_module(f) for f in PIPELINES.rglob("*.py") if f.name != "__main__.py")
    assert "pipelines.stages" in modules and "pipelines.data.corpus" in modules
    code = f"""import importlib, sys
from pipelines import cli
parser = cli.build_parser()
for command in parser._subparsers._group_actions[0].choices:
    parser.parse_args([command, "source", "--out", "x"] if command == "convert" else [command])
for m in {modules!r}:
    importlib.import_module(m)
assert "ray" not in sys.modules, "loaded ray on import"
# a real command without --ray, run to the end (main leaves a Ray runtime it joined, if any, on the way out)
assert cli.main(["corpus", "--out", {str(tmp_path / "run")!r}, "--n-stories", "20"]) == 0
assert "ray" not in sys.modules, "loaded ray running a command"
"""
    _python(code)


def test_the_parser_loads_neither_transformer_lens_nor_sae_lens():
    # together they take 8-10 s to import: `--help`, and a flag refused, answer in the time of torch's import
    code = """import sys
from pipelines import cli
parser = cli.build_parser()
for command in parser._subparsers._group_actions[0].choices:
    parser.parse_args([command, "source", "--out", "x"] if command == "convert" else [command])
heavy = sorted(m for m in ("transformer_lens", "sae_lens", "transformers") if m in sys.modules)
assert not heavy, f"building the parser loaded {heavy}"
"""
    _python(code)


def test_a_stage_command_loads_no_plotting_library():
    # matplotlib takes about 0.6 s to import, a tenth of the verdicts stage's start: only the report draws
    code = """import sys
from pipelines import cli
parser = cli.build_parser()
parser.parse_args(["verdicts"])
import pipelines.stages, pipelines.stages.verdicts, pipelines.analysis.judge
assert "matplotlib" not in sys.modules, "a stage's command loaded matplotlib"
"""
    _python(code)


def _banned(name: str) -> bool:
    return any(name == b or name.startswith(b + ".") for b in NOT_IN_CIRCUITS)


def test_no_circuits_module_imports_tables_progress_or_threads():
    files = sorted(CIRCUITS.rglob("*.py"))
    assert len(files) >= 10  # the folder was found
    offending = [f"{f.relative_to(ROOT)}:{line} imports {name}" for f in files for line, name in _imported(f)
                 if _banned(name) or name.startswith("pipelines")]
    assert not offending, "\n".join(offending)


def test_loading_every_circuits_module_loads_no_tables_progress_or_threads():
    # torch itself loads tqdm and concurrent.futures: what counts is what circuits adds to torch and numpy
    modules = sorted(_module(f) for f in CIRCUITS.rglob("*.py"))
    code = f"""import importlib, sys
import numpy, torch
banned = {NOT_IN_CIRCUITS!r}
loaded = lambda: {{m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in banned)}}
before = loaded()
for m in {modules!r}:
    importlib.import_module(m)
added = sorted(loaded() - before)
assert not added, f"importing circuits loaded {{added}}"
assert "pandas" not in sys.modules, "loaded pandas"
"""
    _python(code)


def _python(code: str) -> None:
    """Run `code` in a fresh interpreter (this one may have loaded anything already)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
