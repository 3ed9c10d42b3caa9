"""Each concept has one home: the site names live in `circuits.sites` and the run's file
names in `pipelines.engine.paths`; no other module of the package spells them out."""

from __future__ import annotations

import ast
from pathlib import Path

from circuits import sites
from pipelines.engine import paths

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("circuits", "sae", "pipelines", "benchmarks")


def _literals(home: Path) -> list[tuple[Path, int, str]]:
    """(file, line, value) of every string constant in the package's modules but `home`."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == home:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.append((path, node.lineno, node.value))
    return found


def _offending(home: Path, values: set[str], allowed: dict[str, set[str]]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} spells {value!r}" for path, line, value in _literals(home)
            if value in values and value not in allowed.get(str(path.relative_to(ROOT)), set())]


def test_site_names_are_spelt_only_in_the_sites_module():
    names = set(sites.SITES)
    assert names == {"resid_mid", "mlp_in", "mlp_out"}  # the scan looks for something
    offending = _offending(Path(sites.__file__).resolve(), names, {})
    assert not offending, "\n".join(offending)


def test_run_file_names_are_spelt_only_in_the_paths_module():
    names = {value for name, value in vars(paths).items() if name.isupper() and isinstance(value, str)}
    assert {".stamp.json", "summary.json", "token_counts.npy", "corpus.json", "model.safetensors"} <= names
    # other formats that happen to use one of our names: the published checkpoints' weights
    # file, and the SAE folders, whose format (sae-lens's, the paper authors', our extras) is
    # the sae package's own (it never imports pipelines)
    foreign = {"pipelines/lm/convert.py": {"model.safetensors"},
               "sae/io.py": {"config.json", "model.safetensors", "train_config.json"}}
    offending = _offending(Path(paths.__file__).resolve(), names, foreign)
    assert not offending, "\n".join(offending)
