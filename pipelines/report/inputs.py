"""What the report shows, gathered from the run's tables and, for one figure, the weights.

Tables are read for the chosen layers and for one set of circuit tables per layer: the
output SAE's features analysed from the input SAE at `input_site`. Every number and every
verdict comes from a table; only the interaction heatmap, a block of `Qt` the tables do not
hold whole, is computed with `circuits` from the same model and SAEs the tables were
computed with (checked).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from circuits.bilinear import interaction_matrices
from circuits.sae_basis import input_basis, project
from circuits.sites import input_gain
from circuits.weights import from_hooked_transformer
from pipelines import schemas
from pipelines.data.tags import GateTag, present_tags
from pipelines.engine.files import read_json
from pipelines.engine.paths import ModelPaths, RunPaths
from pipelines.inputs import LayerSAEs

SCATTER_RANKS = (1, 2)  # ranks of lowrank_samples a scatter shows, with the largest stored


@dataclass
class ReportData:
    """The run's tables (None where missing) for the chosen layers and input site, each read
    on first use."""

    run: RunPaths
    layers: list[int]
    input_site: str
    lm_summary: dict | None
    model_config: dict | None
    _tables: dict[str, pd.DataFrame | None] = field(default_factory=dict, repr=False)

    def table(self, name: str) -> pd.DataFrame | None:
        if name not in self._tables:
            self._tables[name] = schemas.select(schemas.read(self.run.tables, name, self.layers), self.input_site)
        return self._tables[name]

    @property
    def verdicts(self) -> pd.DataFrame | None:
        """The verdicts stage's table (`gate_verdicts`): what the report says of every candidate."""
        return self.table("gate_verdicts")

    @property
    def has_verdicts(self) -> bool:
        """Whether the verdicts stage has run for any of the layers."""
        return self.verdicts is not None and len(self.verdicts) > 0

    @property
    def tags(self) -> tuple[GateTag, ...]:
        """The gate tags the verdicts carry (those the corpus's labels let speak, `pipelines.data.tags`)."""
        return present_tags(self.verdicts, schemas.GATE_TAGS)


def load_report_data(run: RunPaths, layers: list[int], input_site: str, model_dir) -> ReportData:
    files = ModelPaths(model_dir)
    return ReportData(run, layers, input_site, read_json(files.summary), read_json(files.config))


def scatter_samples(samples: pd.DataFrame | None, layer: int, feature: int | None = None) -> pd.DataFrame:
    """The `lowrank_samples` rows a scatter of one output feature shows (the report's and the
    explorer's): ranks 1, 2 and the largest stored; with no `feature`, those of every output
    feature of the layer, feature after feature in their order in `samples`."""
    if samples is None or samples.empty:
        return pd.DataFrame(columns=schemas.TABLES["lowrank_samples"].names)
    mine = samples[samples["layer"] == layer] if "layer" in samples else samples
    if feature is not None:
        mine = mine[mine["out_feature"] == feature]
    if mine.empty:
        return mine
    # all features in one frame: a filter per feature made the explorer's layers quadratic
    mine = mine.assign(_order=pd.factorize(mine["out_feature"])[0])
    largest = mine.groupby("out_feature")["n_eigs"].transform("max")
    mine = mine[mine["n_eigs"].isin(SCATTER_RANKS) | (mine["n_eigs"] == largest)]
    return mine.sort_values(["_order", "n_eigs", "sample"], kind="stable").drop(columns="_order")


def scatter_panels(samples: pd.DataFrame) -> list[tuple[str, np.ndarray, np.ndarray, float]]:
    """The panels of `figures.scatter` for one feature's `scatter_samples`: per rank, the
    approximation (plus the encoder offset, making it the pre-activation, when known), the
    activation and their correlation on the sampled tokens."""
    panels = []
    for r, rows in samples.groupby("n_eigs"):
        offset = rows["offset"].to_numpy()
        x = rows["approx"].to_numpy() + (np.nan_to_num(offset) if np.isfinite(offset).all() else 0.0)
        y = rows["activation"].to_numpy()
        corr = float(np.corrcoef(x, y)[0, 1]) if len(y) > 1 and x.std() > 0 and y.std() > 0 else float("nan")
        panels.append((f"rank {r}", x, y, corr))
    return panels


def interaction_submatrix(model, layer: int, feature: int, saes: LayerSAEs, inputs: list[int]) -> np.ndarray:
    """`Qt` of one output feature over the given input features (`circuits.sae_basis.project`)."""
    mlp = from_hooked_transformer(model, layer).to(torch.float64)
    w_in = saes.sae_in.weights
    basis = input_basis(w_in.W_dec.double(), w_in.b_dec.double(), input_gain(saes.input_site, mlp.g))
    u = saes.sae_out.weights.W_enc.T[feature : feature + 1].double()
    Q = interaction_matrices(mlp.W_gate, mlp.W_in, mlp.W_out, u)[0]
    return project(Q, basis[:, inputs]).cpu().numpy()
