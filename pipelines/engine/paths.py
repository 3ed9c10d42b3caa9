"""The layout of a run directory, in one place (see results/README.md).

Every file name of a run is defined here and every path is a property of `RunPaths` (or,
for a model folder, which may lie outside a run, of `ModelPaths`); writers that fill a
temporary folder first (`pipelines.engine.files.atomic_dir`) use the same names.

One stamp convention (`pipelines.engine.stamps`): a folder of outputs carries its stamp
inside, hidden (`stamp_of(folder)`, so the folder's content digest leaves it out), and
written last; table parts, which share their folders, are stamped under `tables/.stamps/`
(`RunPaths.table_stamp`). A folder being filled by resumable work carries a work stamp
(`work_stamp_of`) saying which inputs the unfinished work is for.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STAMP = ".stamp.json"
WORK_STAMP = ".work.json"
LOCK = ".lock"
DEMO_CONFIG = "demo_config.json"
INDEX = "index.html"  # the report's and the explorer's page
# a model folder (our checkpoint format, and what training leaves beside it)
MODEL_CONFIG = "config.json"
MODEL_WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
TRAIN_CONFIG = "train_config.json"
TRAIN_LOG = "train_log.parquet"
TRAIN_STATE = "train_state.pt"
SUMMARY = "summary.json"  # held-out loss, bits per byte, behaviour
TOKEN_COUNTS = "token_counts.npy"  # in a model folder and in a token store
TRAINED_CORPUS = "corpus.json"  # the corpus the model was trained on, for later stages' defaults
GRAPH_METADATA = "graph-metadata.json"  # circuit-tracer's index of the graphs in a folder
# the built-in corpus
CORPUS_PART = "part.parquet"
LEXICON = "lexicon.tsv"
STORY_CONFIG = "story_config.json"


def stamp_of(folder: Path) -> Path:
    """The stamp of a folder of outputs."""
    return Path(folder) / STAMP


def work_stamp_of(folder: Path) -> Path:
    """The stamp of unfinished, resumable work in a folder."""
    return Path(folder) / WORK_STAMP


@dataclass(frozen=True)
class ModelPaths:
    """The files of a model folder: the checkpoint and, for a model trained here, its training's."""

    folder: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "folder", Path(self.folder))

    @property
    def config(self) -> Path:
        return self.folder / MODEL_CONFIG

    @property
    def weights(self) -> Path:
        return self.folder / MODEL_WEIGHTS

    @property
    def tokenizer(self) -> Path:
        return self.folder / TOKENIZER

    @property
    def train_config(self) -> Path:
        return self.folder / TRAIN_CONFIG

    @property
    def train_log(self) -> Path:
        return self.folder / TRAIN_LOG

    @property
    def train_state(self) -> Path:
        """The checkpoint of unfinished training (gone once the model is finished)."""
        return self.folder / TRAIN_STATE

    @property
    def summary(self) -> Path:
        return self.folder / SUMMARY

    @property
    def token_counts(self) -> Path:
        """How often each token occurred in the training split."""
        return self.folder / TOKEN_COUNTS

    @property
    def trained_corpus(self) -> Path:
        return self.folder / TRAINED_CORPUS

    @property
    def stamp(self) -> Path:
        return stamp_of(self.folder)

    @property
    def work_stamp(self) -> Path:
        return work_stamp_of(self.folder)


@dataclass(frozen=True)
class RunPaths:
    """Where each stage of a run reads and writes, under `root` (e.g. `results/demo`)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def lock(self) -> Path:
        """Held by the command working on the run (`pipelines.engine.lock`)."""
        return self.root / LOCK

    @property
    def demo_config(self) -> Path:
        return self.root / DEMO_CONFIG

    @property
    def corpus(self) -> Path:
        """The built-in story corpus, when the run generated one."""
        return self.root / "corpus"

    @property
    def lm(self) -> Path:
        return self.root / "lm"

    @property
    def model(self) -> ModelPaths:
        """The files of the run's own model (`lm/`)."""
        return ModelPaths(self.lm)

    @property
    def tokens(self) -> Path:
        """Tokenized, packed corpora, one folder per (corpus, tokenizer, context) digest."""
        return self.root / "tokens"

    def token_store(self, name: str) -> Path:
        return self.tokens / name

    @property
    def saes(self) -> Path:
        return self.root / "saes"

    def sae(self, layer: int, site: str) -> Path:
        return self.saes / f"layer{layer}_{site}"

    def sae_checkpoint(self, name: str) -> Path:
        """The checkpoint of one group of SAEs trained from one stream."""
        return self.saes / f"checkpoint-{name}.pt"

    def sae_checkpoint_stamp(self, name: str) -> Path:
        """What the group's checkpoint resumes."""
        return self.saes / f".checkpoint-{name}.json"

    def sae_checkpoints(self) -> dict[str, Path]:
        """The SAE checkpoints present, by name."""
        found = self.saes.glob(self.sae_checkpoint("*").name) if self.saes.is_dir() else []
        return {path.stem.removeprefix("checkpoint-"): path for path in found}

    @property
    def tables(self) -> Path:
        return self.root / "tables"

    def table_stamp(self, stage: str, layer: int | None = None, part: str | None = None) -> Path:
        """Stamp of a table-writing stage's outputs for one layer (and part)."""
        name = stage if layer is None else f"{stage}-layer{layer}"
        if part:
            name += f"-{part}"
        return self.tables / ".stamps" / f"{name}.json"

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def report_page(self) -> Path:
        return self.report / INDEX

    @property
    def graphs(self) -> Path:
        """Attribution graphs: circuit-tracer's JSON per prompt and graph-metadata.json."""
        return self.root / "graphs"

    @property
    def graph_index(self) -> Path:
        """circuit-tracer's list of the graphs (its viewer reads it)."""
        return self.graphs / GRAPH_METADATA

    @property
    def explorer(self) -> Path:
        return self.root / "explorer"

    @property
    def explorer_page(self) -> Path:
        return self.explorer / INDEX
