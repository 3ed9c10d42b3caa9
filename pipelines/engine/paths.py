"""The layout of a run directory, in one place (see results/README.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    """Where each stage of a run reads and writes, under `root` (e.g. `results/demo`)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def corpus(self) -> Path:
        """The built-in story corpus, when the run generated one."""
        return self.root / "corpus"

    @property
    def lm(self) -> Path:
        return self.root / "lm"

    @property
    def tokens(self) -> Path:
        """Tokenized, packed corpora, one folder per (corpus, tokenizer, context) digest."""
        return self.root / "tokens"

    @property
    def saes(self) -> Path:
        return self.root / "saes"

    @property
    def tables(self) -> Path:
        return self.root / "tables"

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def graphs(self) -> Path:
        """Attribution graphs: circuit-tracer's JSON per prompt and graph-metadata.json."""
        return self.root / "graphs"

    @property
    def explorer(self) -> Path:
        return self.root / "explorer"

    def sae(self, layer: int, site: str) -> Path:
        return self.saes / f"layer{layer}_{site}"

    def stamp(self, stage: str, layer: int | None = None, part: str | None = None) -> Path:
        """Stamp of a table-writing stage's outputs for one layer (and output set)."""
        name = stage if layer is None else f"{stage}-layer{layer}"
        if part:
            name += f"-{part}"
        return self.tables / ".stamps" / f"{name}.json"
