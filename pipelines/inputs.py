"""What the analysis stages read: a model folder, loaded lazily, and each layer's SAEs,
checked to be the ones the layer's analysis needs.

The stages (`pipelines.stages`), the report and the explorer's callers take these objects;
nothing here writes anything.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from circuits.layer import LayerBatch
from circuits.sae_basis import token_scale
from pipelines.data.tokenizer import load_tokenizer
from pipelines.data.corpus import CorpusConfig
from pipelines.data.tokens import TokenRows, TokenStore, open_token_store
from pipelines.engine.files import digest, read_json, readable_name
from pipelines.engine.paths import ModelPaths, RunPaths, stamp_of
from pipelines.engine.tables import provenance, table_path
from pipelines.lm.model import ModelConfig, load_config, load_model, model_digest
from sae.activations import check_tokens
from sae.io import LoadedSAE, check_sae_point, load_sae
from circuits.forward import Streams
from circuits.sites import INPUT_SITES, MLP_IN, OUTPUT_SITE, SITES, Point, check_points

if TYPE_CHECKING:  # annotations only: importing TransformerLens takes seconds
    from transformer_lens import HookedTransformer

SAEPaths = tuple[Path, Path | None]  # explicit (input, output) SAE folders of one layer


class _once(cached_property):
    """`functools.cached_property` computed once even when threads ask at once: a stage's
    tasks may run side by side and share their inputs (`Runtime.tasks_at_once`), and Python
    3.12 dropped the lock `cached_property` held (two tasks would load the model twice)."""

    def __init__(self, func):
        super().__init__(func)
        self.lock = threading.RLock()

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        with self.lock:
            return super().__get__(instance, owner)


@dataclass
class ModelInputs:
    """A model folder, loaded lazily, with its tokenizer and digest."""

    folder: Path
    device: str = "cpu"
    config: ModelConfig = field(init=False)

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        self.config = load_config(self.folder)  # cheap: usage errors come before any loading

    @_once
    def model(self) -> HookedTransformer:
        model, _ = load_model(self.folder, self.device)
        return model

    @_once
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.folder)

    @_once
    def digest(self) -> str:
        return model_digest(self.folder)

    @_once
    def token_counts(self) -> np.ndarray | None:
        """How often each token occurred in training (None for a foreign model)."""
        path = ModelPaths(self.folder).token_counts
        return np.load(path) if path.is_file() else None

    @_once
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

    @_once
    def streams(self) -> Streams:
        """The held-out rows' residual streams, kept between the layers this process's tasks
        analyse (`forward.Streams`): layers run here (not on Ray, where each task reopens its
        inputs) each resume from the stream an earlier layer's task left, rather than run
        every block from the embedding; tasks that run at once share it (a stream is resumed
        only at or below the layer asked for). A stage frees them when it ends (`forget_streams`)."""
        return Streams(self.lm.model)

    def forget_streams(self) -> None:
        """Free the kept streams, if any were made: the next stage reads other rows."""
        if "streams" in vars(self):
            self.streams.clear()

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


SAE_OUTPUTS = "sae"  # the --outputs entry of the output SAE's features: they get data statistics and verdicts


def outputs_name(spec: str, basis: str) -> str:
    """The `outputs` column of an output set: the spec, or for SAE features read by their
    decoder rows `sae-decoder`."""
    return f"{SAE_OUTPUTS}-decoder" if spec == SAE_OUTPUTS and basis == "decoder" else spec


def part_name(input_site: str, spec: str, basis: str) -> str:
    """File name of one output set's tables within a layer's folder, e.g. `resid_mid-sae`; a spec
    with a value is named by its kind, the value's words and a digest of the spec, e.g.
    `resid_mid-logit-happy-sad-<digest>` or `resid_mid-file-dirs-npy-<digest>`."""
    name = outputs_name(spec, basis)
    if ":" in name:
        kind, value = spec.split(":", 1)
        words = Path(value).name if kind == "file" else value  # a path reads as its file's name
        name = f"{kind}-{readable_name(words, spec, width=24, digits=8)}"
    return f"{input_site}-{name}"


@dataclass(frozen=True)
class LayerPlan:
    """Which SAEs one layer's analysis reads and where its tables go, resolved once per
    command (`pipelines.jobs.SAEChoice.plan`) and handed to every stage and the report."""

    layer: int
    input_site: str  # where the circuit tables' input SAE reads
    folders: dict[str, Path]  # site -> SAE folder: the ones named (--sae-in/--sae-out), or the run's own
    explicit: bool = False  # the SAEs were named rather than the run's own
    allow_hookless: bool = False  # named SAEs that record no hook are taken to read this layer and site

    @property
    def sae_in(self) -> Path:
        return self.folders[self.input_site]

    @property
    def sae_out(self) -> Path | None:
        return self.folders.get(OUTPUT_SITE)

    @property
    def part(self) -> str:
        """The part of the output SAE's features read by their encoder rows: the tables the
        verdicts, the report and the explorer read."""
        return part_name(self.input_site, SAE_OUTPUTS, "encoder")

    def has_saes(self) -> bool:
        """Whether both SAEs exist (a run's own are absent before `train-saes`)."""
        return self.sae_in.is_dir() and self.sae_out is not None and self.sae_out.is_dir()

    def saes(self, inputs: ModelInputs, need_output: bool = True) -> LayerSAEs:
        """Load and check the layer's SAEs."""
        d_model = inputs.config.d_model
        sae_in = load_sae(self.sae_in, inputs.device)
        check_sae_point(sae_in, d_model, self.layer, (self.input_site,), "input", self.allow_hookless)
        check_sae_model(self.sae_in, inputs, "input")
        sae_out = None
        if need_output:
            if self.sae_out is None:
                raise ValueError(f"layer {self.layer}: outputs 'sae' need an output SAE (--sae-out)")
            sae_out = load_sae(self.sae_out, inputs.device)
            check_sae_point(sae_out, d_model, self.layer, (OUTPUT_SITE,), "output", self.allow_hookless)
            check_sae_model(self.sae_out, inputs, "output")
        return LayerSAEs(self.layer, sae_in, self.input_site, sae_out)

    def described(self, inputs: ModelInputs, sites: tuple[str, ...]) -> dict[Point, LoadedSAE]:
        """The SAEs of the layer to describe: the named ones, or the run's of `sites` that exist."""
        wanted = self.folders if self.explicit else {s: self.folders[s] for s in sites if self.folders[s].is_dir()}
        if not wanted:
            raise FileNotFoundError(f"no SAEs of layer {self.layer} in {self.folders[sites[0]].parent} for sites "
                                    f"{', '.join(sites)}: run `train-saes` first or pass --sae-in/--sae-out")
        found = {}
        for site, folder in wanted.items():
            sae = load_sae(folder, inputs.device)
            role = "output" if site == OUTPUT_SITE else "input"
            check_sae_point(sae, inputs.config.d_model, self.layer, (site,), role, self.allow_hookless)
            check_sae_model(folder, inputs, role)
            found[(self.layer, site)] = sae
        return found


def check_sae_model(folder: Path, inputs: ModelInputs, role: str) -> None:
    """Refuse an SAE that records training on another model than `inputs` (an SAE trained by
    this toolkit stamps the digest of the model it read; one from elsewhere records none, and
    only its width and hook can be checked)."""
    recorded = (read_json(stamp_of(folder)) or {}).get("inputs", {}).get("model")
    if recorded is None:
        return
    inputs.model  # loaded first: a model that does not load (non-finite weights...) is the error to name
    if recorded != inputs.digest:
        raise ValueError(f"the {role} SAE {folder} was trained on another model than {inputs.folder} (its stamp "
                         f"records model {recorded[:12]}, this one is {inputs.digest[:12]}): pass this model's SAEs, "
                         "or retrain them with `train-saes`")


def plan_layers(run: RunPaths, inputs: ModelInputs, layers: list[int], explicit: SAEPaths | None, input_site: str,
                allow_hookless: bool = False) -> dict[int, LayerPlan]:
    """Each layer's plan: the named SAEs (`explicit`, for a single layer; their input site is
    the one their hook records) or the run's own, read at `input_site`."""
    if explicit is None:
        return {layer: LayerPlan(layer, input_site, {site: run.sae(layer, site) for site in SITES})
                for layer in layers}
    (layer,) = layers
    path_in, path_out = explicit
    sae_in = load_sae(path_in, inputs.device)
    sites = (input_site,) if sae_in.point is None and allow_hookless else INPUT_SITES
    site = check_sae_point(sae_in, inputs.config.d_model, layer, sites, "input", allow_hookless)
    folders = {site: Path(path_in)} | ({OUTPUT_SITE: Path(path_out)} if path_out is not None else {})
    return {layer: LayerPlan(layer, site, folders, True, allow_hookless)}


def layer_batches(model: HookedTransformer, rows: TokenRows, n_rows: int, saes: LayerSAEs, batch_rows: int = 32,
                  streams: Streams | None = None):
    """A callable giving a fresh pass of `LayerBatch`es over the first `n_rows` rows.
    `streams`: where the rows' residual streams are kept between layers (`forward.Streams`,
    keyed by each batch's first row); by default every pass runs from the embedding and
    nothing is kept."""
    layer, site = saes.layer, saes.input_site
    points = sorted({(layer, MLP_IN), (layer, OUTPUT_SITE), (layer, site)})
    check_points(model, points)
    eps = float(model.cfg.eps)
    streams = Streams(model, keep=False) if streams is None else streams

    def batches():
        for part, tokens in rows.iter_batches(batch_rows, n_rows):
            check_tokens(tokens, model)
            keep = rows.keep(tokens).to(model.cfg.device)
            if not keep.any():
                continue
            _, found = streams.layer(part.start, tokens, layer, points)
            acts = {point: value[keep] for point, value in found.items()}
            source = acts[(layer, site)]
            yield LayerBatch(x=acts[(layer, MLP_IN)], z=saes.sae_in.weights.encode(source),
                             scale=token_scale(source, eps, site),
                             acts=saes.sae_out.weights.encode(acts[(layer, OUTPUT_SITE)]))

    return batches


def check_tables_match(run: RunPaths, plan: LayerPlan, features: bool = False) -> None:
    """Refuse to use a layer's tables with SAEs other than those they were computed with:
    its circuit tables and, with `features`, the features tables of both SAEs, which must
    then exist (what the verdicts read)."""
    recorded = provenance(table_path(run.tables, "gates", plan.layer, plan.part))
    now = {"sae_in": digest(plan.sae_in)}
    if plan.sae_out is not None:
        now["outputs"] = digest(plan.sae_out)
    changed = [name for name, value in now.items() if recorded is not None and recorded["inputs"].get(name) != value]
    if features and recorded is not None:  # without circuit tables the stage says to run `circuits`
        for site, folder in ((plan.input_site, plan.sae_in), (OUTPUT_SITE, plan.sae_out)):
            described = features_describe(run, plan.layer, site, folder)
            if described is None:
                raise FileNotFoundError(f"layer {plan.layer}: no features table of the {site} SAE in {run.tables}: "
                                        "run `features` first (the verdicts read the features' labels and boosted "
                                        "words)")
            if not described:
                changed.append(f"features of {site}")
    if changed:
        raise ValueError(f"the layer {plan.layer} tables in {run.tables} were computed with other SAEs than "
                         f"{', '.join(str(p) for p in (plan.sae_in, plan.sae_out) if p)} ({', '.join(changed)} "
                         "differ); rerun `circuits` and `features` with these SAEs or pass the ones the tables were "
                         "computed with")


def features_describe(run: RunPaths, layer: int, site: str, folder: Path | None) -> bool | None:
    """Whether the run's features table of (layer, site) describes the SAE in `folder` (by the
    SAE digest its provenance records; a table written by hand records none and is taken as
    it is); None when there is no such table."""
    path = table_path(run.tables, "features", layer, site)
    if not path.is_file():
        return None
    found = provenance(path)
    return found is None or (folder is not None and found["inputs"].get("sae") == digest(folder))


def check_features_describe(run: RunPaths, plan: LayerPlan) -> None:
    """Refuse to label a layer's latents from a features table of other SAEs than the plan's
    (their descriptions would name other latents); a missing table is no error (no labels)."""
    for site, folder in ((plan.input_site, plan.sae_in), (OUTPUT_SITE, plan.sae_out)):
        if features_describe(run, plan.layer, site, folder) is False:
            raise ValueError(f"the layer {plan.layer} {site} features table in {run.tables} describes another SAE "
                             f"than {folder}, so its labels would name other latents: rerun `features` with these "
                             "SAEs, or pass the ones it describes")


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
    return _resolved(data["source"], model_dir), cfg.replace(negation=_resolved(cfg.negation, model_dir))
