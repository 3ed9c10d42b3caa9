"""What the analysis stages read: a model folder, loaded lazily, and each layer's SAEs,
checked to be the ones the layer's analysis needs.

The stages (`pipelines.stages`), the report and the explorer's callers take these objects;
nothing here writes anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from transformer_lens import HookedTransformer

from circuits.layer import LayerBatch
from circuits.sae_basis import token_scale
from pipelines.data.tokenizer import load_tokenizer
from pipelines.data.corpus import CorpusConfig
from pipelines.data.tokens import TokenRows, TokenStore, open_token_store
from pipelines.engine.files import digest, read_json
from pipelines.engine.paths import ModelPaths, RunPaths
from pipelines.engine.tables import provenance, table_path
from pipelines.lm.model import ModelConfig, load_config, load_model, model_digest
from sae.activations import iter_activations
from sae.io import LoadedSAE, check_sae_point, load_sae
from circuits.sites import INPUT_SITES, MLP_IN, OUTPUT_SITE, Point

SAEPaths = tuple[Path, Path | None]  # explicit (input, output) SAE folders of one layer


@dataclass
class ModelInputs:
    """A model folder, loaded lazily, with its tokenizer and digest."""

    folder: Path
    device: str = "cpu"
    config: ModelConfig = field(init=False)

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        self.config = load_config(self.folder)  # cheap: usage errors come before any loading

    @cached_property
    def model(self) -> HookedTransformer:
        model, _ = load_model(self.folder, self.device)
        return model

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.folder)

    @cached_property
    def digest(self) -> str:
        return model_digest(self.folder)

    @cached_property
    def token_counts(self) -> np.ndarray | None:
        """How often each token occurred in training (None for a foreign model)."""
        path = ModelPaths(self.folder).token_counts
        return np.load(path) if path.is_file() else None

    @cached_property
    def untrained(self) -> np.ndarray:
        """Token ids the model never saw in training (or, for a foreign model, none known)."""
        if self.token_counts is None:
            return np.zeros(0, dtype=np.int64)
        return np.nonzero(self.token_counts == 0)[0]


def _ignore(tokens: int) -> None:
    """Progress reports of work done here: its own progress bars show it."""


@dataclass
class StageInputs:
    """What an analysis stage's tasks read: the run directory, the model and the token store,
    and where a task reports the tokens it has processed (the driver's display on Ray)."""

    run: RunPaths
    lm: ModelInputs
    store: TokenStore
    report: Callable[[int], None] = _ignore

    def folders(self) -> dict[str, str]:
        """Where each lives, for a worker to reopen them (`reopen`)."""
        return {"run": str(Path(self.run.root).resolve()), "model": str(self.lm.folder.resolve()),
                "tokens": str(Path(self.store.folder).resolve())}

    @classmethod
    def reopen(cls, folders: dict[str, str], device: str, report: Callable[[int], None] = _ignore) -> "StageInputs":
        return cls(RunPaths(folders["run"]), ModelInputs(Path(folders["model"]), device),
                   open_token_store(folders["tokens"]), report)


@dataclass
class LayerSAEs:
    """The SAEs of one layer's analysis and where the input one reads."""

    layer: int
    sae_in: LoadedSAE
    input_site: str
    sae_out: LoadedSAE | None


def layer_saes(run: RunPaths, inputs: ModelInputs, layer: int, explicit: SAEPaths | None, input_site: str,
               need_output: bool, allow_hookless: bool = False) -> LayerSAEs:
    """Load and check a layer's SAEs: explicit paths, or the run's own for `input_site`."""
    path_in, path_out = explicit or (run.sae(layer, input_site), run.sae(layer, OUTPUT_SITE))
    d_model = inputs.config.d_model
    sae_in = load_sae(path_in, inputs.device)
    sites = INPUT_SITES if explicit else (input_site,)
    if sae_in.point is None and allow_hookless:
        sites = (input_site,)
    site = check_sae_point(sae_in, d_model, layer, sites, "input", allow_hookless)
    sae_out = None
    if need_output:
        if path_out is None:
            raise ValueError(f"layer {layer}: outputs 'sae' need an output SAE (--sae-out)")
        sae_out = load_sae(path_out, inputs.device)
        check_sae_point(sae_out, d_model, layer, (OUTPUT_SITE,), "output", allow_hookless)
    return LayerSAEs(layer, sae_in, site, sae_out)


def feature_saes(run: RunPaths, inputs: ModelInputs, layer: int, sites: tuple[str, ...], explicit: SAEPaths | None,
                 allow_hookless: bool) -> dict[Point, LoadedSAE]:
    """The SAEs of a layer to describe: explicit ones, or the run's for `sites` that exist."""
    d_model = inputs.config.d_model
    found = {}
    if explicit is not None:
        path_in, path_out = explicit
        sae_in = load_sae(path_in, inputs.device)
        found[(layer, check_sae_point(sae_in, d_model, layer, INPUT_SITES, "input", allow_hookless))] = sae_in
        if path_out is not None:
            sae_out = load_sae(path_out, inputs.device)
            check_sae_point(sae_out, d_model, layer, (OUTPUT_SITE,), "output", allow_hookless)
            found[(layer, OUTPUT_SITE)] = sae_out
        return found
    for site in sites:
        folder = run.sae(layer, site)
        if folder.is_dir():
            sae = load_sae(folder, inputs.device)
            check_sae_point(sae, d_model, layer, (site,), "output" if site == OUTPUT_SITE else "input")
            found[(layer, site)] = sae
    if not found:
        raise FileNotFoundError(f"no SAEs of layer {layer} in {run.saes} for sites {', '.join(sites)}: "
                                "run `train-saes` first or pass --sae-in/--sae-out")
    return found


def layer_batches(model: HookedTransformer, rows: TokenRows, n_rows: int, saes: LayerSAEs, batch_rows: int = 32):
    """A callable giving a fresh pass of `LayerBatch`es over the first `n_rows` rows."""
    layer, site = saes.layer, saes.input_site
    points = sorted({(layer, MLP_IN), (layer, OUTPUT_SITE), (layer, site)})
    eps = float(model.cfg.eps)

    def batches():
        for _, tokens in rows.iter_batches(batch_rows, n_rows):
            for acts in iter_activations(model, tokens, points, rows.keep(tokens), batch_rows):
                source = acts[(layer, site)]
                yield LayerBatch(x=acts[(layer, MLP_IN)], z=saes.sae_in.weights.encode(source),
                                 scale=token_scale(source, eps, site),
                                 acts=saes.sae_out.weights.encode(acts[(layer, OUTPUT_SITE)]))

    return batches


def check_tables_match(run: RunPaths, layer: int, part: str, sae_in: Path, sae_out: Path | None) -> None:
    """Refuse to show a layer's tables next to SAEs other than those they were computed with."""
    recorded = provenance(table_path(run.tables, "gates", layer, part))
    if recorded is None:
        return
    now = {"sae_in": digest(sae_in)}
    if sae_out is not None:
        now["outputs"] = digest(sae_out)
    changed = [name for name, value in now.items() if recorded["inputs"].get(name) != value]
    if changed:
        raise ValueError(f"the layer {layer} tables in {run.tables} were computed with other SAEs than "
                         f"{', '.join(str(p) for p in (sae_in, sae_out) if p)} ({', '.join(changed)} differ); "
                         "rerun `circuits` with these SAEs or pass the ones the tables were computed with")


RUN_RELATIVE = "@run/"  # a recorded path inside the model's run directory: it moves with the run


def portable(source: str, lm: Path) -> str:
    """A path as recorded next to the model: relative to the run when it lies in it."""
    path = Path(source)
    if source.startswith("hf:") or not path.exists():
        return source
    try:
        return RUN_RELATIVE + str(path.resolve().relative_to(lm.resolve().parent))
    except ValueError:
        return str(path.resolve())


def _resolved(recorded: str, model_dir: Path) -> str:
    if recorded.startswith(RUN_RELATIVE):
        return str(Path(model_dir).parent / recorded[len(RUN_RELATIVE):])
    return recorded


def trained_corpus(model_dir: Path) -> tuple[str, CorpusConfig] | None:
    """The corpus a model of this run was trained on, with its settings, if recorded."""
    data = read_json(ModelPaths(model_dir).trained_corpus)
    if data is None:
        return None
    cfg = CorpusConfig.from_json(data["config"])
    if cfg.lexicon:
        cfg = cfg.replace(lexicon=_resolved(cfg.lexicon, model_dir))
    return _resolved(data["source"], model_dir), cfg
