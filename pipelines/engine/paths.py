"""The layout of a run directory, in one place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    """Where each stage of a run reads and writes, under `root` (e.g. `results/demo`)."""

    root: Path

    @property
    def corpus(self) -> Path:
        return self.root / "corpus"

    @property
    def lm(self) -> Path:
        return self.root / "lm"

    @property
    def saes(self) -> Path:
        return self.root / "saes"

    @property
    def tables(self) -> Path:
        return self.root / "tables"

    @property
    def report(self) -> Path:
        return self.root / "report"

    def sae(self, layer: int, site: str) -> Path:
        return self.saes / f"layer{layer}_{site}"
