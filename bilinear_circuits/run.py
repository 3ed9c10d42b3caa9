"""A run folder (what `bilinear-circuits demo` or the stage commands wrote) as one object."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import pandas as pd

from bilinear_circuits.feature import Feature, with_descriptions
from bilinear_circuits.graph import Graph
from bilinear_circuits.layer import Layer
from circuits.sites import DEFAULT_INPUT_SITE, INPUT_SITES, SITES

# tables read per output feature (the circuits and verdicts stages' tables with `out_feature`)
FEATURE_TABLES = ("interactions", "gates", "gate_truth", "eigen", "eigen_inputs", "lowrank", "lowrank_samples",
                  "pair_gates", "gate_ablation", "group_gates", "group_truth", "group_ablation", "gate_verdicts")


def open_run(folder: str | Path, device: str = "cpu", input_site: str = DEFAULT_INPUT_SITE) -> "Run":
    """Open a run folder: its model, tokenizer, SAEs and tables (see `Run`)."""
    return Run(folder, device, input_site)


class Run:
    """A run folder: the model (a `HookedTransformer`), its tokenizer, the SAEs by layer and
    site, every table as a DataFrame, and per-feature, per-layer and per-prompt views.

    Args:
        folder: the run directory (`results/demo` by default on the command line).
        device: where the model and SAEs are loaded.
        input_site: which input SAEs' circuit tables to read (`resid_mid`, or `mlp_in` when the
            run has them).

    Everything loads on first use and is kept for later calls (the model, the SAEs, the token
    store, each `Layer`, the graphs' float64 copy of the model). Tables are filtered to the
    output SAE's features (the `outputs` value `sae`) and `input_site`, as the report and the
    explorer show them.
    """

    def __init__(self, folder: str | Path, device: str = "cpu", input_site: str = DEFAULT_INPUT_SITE):
        from pipelines.engine.paths import RunPaths
        from pipelines.inputs import ModelInputs

        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise FileNotFoundError(f"folder {self.folder}: no such run directory")
        if input_site not in INPUT_SITES:
            raise ValueError(f"input_site must be one of {', '.join(INPUT_SITES)}, got {input_site!r}")
        self.paths = RunPaths(self.folder)
        self.input_site = input_site
        self.device = device
        self._inputs = ModelInputs(self.paths.lm, device)
        self._tables: dict[str, pd.DataFrame | None] = {}
        # what a notebook asks for again and again, loaded on the first ask
        self._layer_objects: dict[int, Layer] = {}
        self._pairs: dict[int, object] = {}  # layer -> LayerSAEs at input_site
        self._graph_saes: dict[str, dict] = {}  # input site -> {layer: float64 LayerSAETensors}

    def __repr__(self) -> str:
        return f"Run({str(self.folder)!r}: {self.config.n_layers} layers, tables {self.table_names})"

    # ------------------------------------------------------------------ model, tokenizer, SAEs

    @property
    def model(self):
        """The bilinear LM, a TransformerLens `HookedTransformer` (loaded once)."""
        return self._inputs.model

    @property
    def tokenizer(self):
        """The model's `tokenizers.Tokenizer`."""
        return self._inputs.tokenizer

    @property
    def config(self):
        """The model's shape (`ModelConfig`)."""
        return self._inputs.config

    @property
    def layers(self) -> list[int]:
        """The model's layers."""
        return list(range(self.config.n_layers))

    @cached_property
    def saes(self) -> dict[tuple[int, str], object]:
        """The run's SAEs by `(layer, site)`, as sae-lens `SAE` objects (loaded once)."""
        from sae_lens import SAE

        found = {}
        for layer in self.layers:
            for site in SITES:
                folder = self.paths.sae(layer, site)
                if folder.is_dir():
                    found[(layer, site)] = SAE.load_from_disk(str(folder), device=self.device)
        return found

    def sae(self, layer: int, site: str):
        """The sae-lens `SAE` of `layer` at `site` (`resid_mid`, `mlp_in` or `mlp_out`)."""
        if (layer, site) not in self.saes:
            raise FileNotFoundError(f"layer {layer}, site {site!r}: the run has no such SAE (it has "
                                    f"{sorted(self.saes)})")
        return self.saes[(layer, site)]

    # ------------------------------------------------------------------ tables

    @property
    def table_names(self) -> list[str]:
        """The tables the run holds."""
        from pipelines.schemas import TABLES

        return [name for name in TABLES if (self.paths.tables / name).is_dir()]

    def _read(self, name: str) -> pd.DataFrame | None:
        from pipelines.schemas import read, select

        if name not in self._tables:
            self._tables[name] = select(read(self.paths.tables, name), self.input_site, "sae")
        return self._tables[name]

    def table(self, name: str, layer: int | None = None, describe: bool = True) -> pd.DataFrame:
        """Table `name` (any of the registry's: `interactions`, `gates`, `lowrank`, `features`,
        `gate_verdicts`, ...), for `layer` or every layer, with a description column beside each
        column that names a feature when `describe`."""
        from pipelines.schemas import TABLES

        if name not in TABLES:
            raise ValueError(f"name: no table {name!r}; tables are {', '.join(TABLES)}")
        frame = self._read(name)
        if frame is None:
            raise FileNotFoundError(f"the run has no {name!r} table (it has {', '.join(self.table_names)}): run the "
                                    f"`{TABLES[name].stage}` stage first")
        if layer is not None:
            frame = frame[frame["layer"] == layer].reset_index(drop=True)
        return with_descriptions(frame, self._read("features"), self.input_site) if describe else frame

    # ------------------------------------------------------------------ features and layers

    @property
    def _part(self) -> str:
        """The file name of the circuit tables of the output SAE's features at `input_site`."""
        from pipelines.inputs import part_name

        return part_name(self.input_site, "sae", "encoder")

    def _circuits_settings(self, layer: int) -> tuple:
        """(CircuitConfig, corr_rows) the `circuits` stage used for `layer`: its stamp's, else
        the demo's config, else the defaults."""
        from circuits.layer import CircuitConfig
        from pipelines.engine.files import read_json
        from pipelines.jobs import CircuitsJob

        recorded = (read_json(self.paths.table_stamp("circuits", layer, self._part)) or {}).get("config")
        if recorded is not None:
            return CircuitConfig.from_json(recorded["analysis"]), recorded["corr_rows"]
        demo = (read_json(self.paths.demo_config) or {}).get("circuits")
        job = CircuitsJob.from_json(demo) if demo is not None else CircuitsJob()
        return job.analysis, job.corr_rows

    @cached_property
    def _store(self):
        """The token store of the corpus the model was trained on (the stages' held-out rows)."""
        from pipelines.calls import corpus_source, stage_inputs
        from pipelines.data.corpus import CorpusConfig

        source, corpus = corpus_source(self.paths, self.paths.lm)
        return stage_inputs(self.paths, self._inputs, source, corpus or CorpusConfig()).store

    def layer(self, layer: int) -> Layer:
        """Layer `layer` with the run's model and SAEs, measured on the held-out tokens the
        `circuits` stage read (its recorded settings: the stamp of the layer's tables, else the
        demo's config, else the defaults), descriptions joined. Made once per layer: later calls
        give the same object."""
        saes = self._layer_saes(layer)
        if layer not in self._layer_objects:
            cfg, rows = self._circuits_settings(layer)
            held_out = self._store.held_out
            tokens = held_out.batch(slice(0, min(rows, len(held_out))))
            found = Layer(self.model, saes.sae_in, saes.sae_out, layer, tokens=tokens, tokenizer=self.tokenizer,
                          config=cfg, input_site=self.input_site, descriptions=self._read("features"),
                          labels=self._read("feature_labels"))
            found._verdict_rows, found._untrained = held_out, self._inputs.untrained
            self._layer_objects[layer] = found
        return self._layer_objects[layer]

    def _rules(self, layer: int):
        """The `VerdictConfig` the verdicts stage used for `layer`: its stamp's, else the demo's
        config, else the defaults."""
        from pipelines.engine.files import read_json
        from pipelines.jobs import VerdictsJob

        recorded = (read_json(self.paths.table_stamp("verdicts", layer, self._part)) or {}).get("config")
        if recorded is None:
            recorded = (read_json(self.paths.demo_config) or {}).get("verdicts")
        if recorded is None:
            return VerdictsJob().rules
        return VerdictsJob.from_json({k: v for k, v in recorded.items() if k != "format"}).rules

    def _layer_saes(self, layer: int):
        """The `LayerSAEs` of `layer` at `input_site`, loaded and checked once."""
        from pipelines.inputs import plan_layers

        if layer not in self.layers:
            raise ValueError(f"layer {layer} does not exist: the model has {self.config.n_layers}")
        if layer not in self._pairs:
            plan = plan_layers(self.paths, self._inputs, [layer], None, self.input_site)[layer]
            self._pairs[layer] = plan.saes(self._inputs)
        return self._pairs[layer]

    def feature(self, layer: int, feature: int, verdicts: bool = True) -> Feature:
        """Output feature `feature` of `layer`: its rows of the run's tables, or, where the run has
        no circuit tables of the layer, the feature analysed alone (`Layer.feature`) and, with
        `verdicts`, judged alone as the verdicts stage would (its recorded rules)."""
        from pipelines.engine.tables import has_table
        from pipelines.report.inputs import interaction_submatrix

        if has_table(self.paths.tables, "interactions", layer, self._part):
            tables = {}
            for name in FEATURE_TABLES:
                frame = self._read(name)
                tables[name] = None if frame is None else frame[(frame["layer"] == layer)
                                                                 & (frame["out_feature"] == feature)]
            n_out = self._read("lowrank")
            if n_out is not None and feature not in set(n_out.loc[n_out["layer"] == layer, "out_feature"]):
                raise ValueError(f"feature: layer {layer} has no output feature {feature}")
            submatrix = lambda inputs: interaction_submatrix(  # noqa: E731
                self.model, layer, feature, self._layer_saes(layer), inputs)
            return Feature(layer, int(feature), self.input_site, tables, self._read("features"), submatrix)
        return self.layer(layer).feature(feature, verdicts, self._rules(layer) if verdicts else None)

    def circuits(self, layer: int | None = None) -> pd.DataFrame:
        """The ranked circuit candidates (`gate_verdicts`: each output's best pair or group gate,
        with its type and verdict) of `layer` or every layer, best first."""
        frame = self.table("gate_verdicts", layer)
        return frame.sort_values(["layer", "circuit_rank"]).reset_index(drop=True)

    @property
    def graphs(self) -> pd.DataFrame:
        """The graphs saved in the run (by the `graph` command or the demo): slug, prompt, the
        attributed tokens, replacement and completeness scores."""
        from pipelines.graph.export import read_index

        saved = read_index(self.paths.graph_index)
        nodes = self._read("graph_nodes")
        rows = []
        for g in saved:
            mine = nodes[(nodes["prompt"] == g["slug"]) & (nodes["kind"] == "logit")] if nodes is not None else None
            rows.append({"slug": g["slug"], "prompt": g["prompt"],
                         "targets": [] if mine is None else mine["token"].tolist(),
                         "replacement": g.get("replacement_score"), "completeness": g.get("completeness_score")})
        return pd.DataFrame(rows, columns=["slug", "prompt", "targets", "replacement", "completeness"])

    def graph(self, prompt: str, config=None, truncate: bool = False) -> Graph:
        """The attribution graph of `prompt` through the run's model and the SAE pairs of every
        layer that has both (`GraphConfig` in `config`); nothing is written (see `Graph.save`).
        The float64 copy of the model and the SAEs are made on the first graph and kept."""
        from pipelines.graph.build import GraphConfig, build_graph, check_graph_request

        cfg = config or GraphConfig(input_site=self.input_site)
        check_graph_request([prompt], ["prompt"], self.tokenizer, cfg, self.config.n_ctx, truncate)
        built = build_graph(prompt, self._graph_model, self.tokenizer, self._graph_saes_at(cfg.input_site), cfg,
                            truncate=truncate)
        return Graph(built, self._read("features"))

    @cached_property
    def _graph_model(self):
        """The float64 copy of the model that graphs are computed on (the model itself untouched)."""
        from pipelines.graph.build import float64_copy

        return float64_copy(self.model)

    def _graph_saes_at(self, input_site: str) -> dict:
        """`{layer: LayerSAETensors}` in float64 of every layer with SAEs at `input_site` and `mlp_out`."""
        from pipelines.graph.build import GraphConfig, load_layer_saes
        from pipelines.jobs import GraphJob

        if input_site not in self._graph_saes:
            job = GraphJob(graph=GraphConfig(input_site=input_site))
            self._graph_saes[input_site] = load_layer_saes(self.paths, self._inputs,
                                                           job.plan(self.paths, self._inputs, self.layers))
        return self._graph_saes[input_site]
