"""What the report shows, gathered from the run's tables and, for a few figures, the model.

Tables are read for the chosen layers and for one set of circuit tables per layer: the
output SAE's features analysed from the input SAE at `input_site`. Figures that need more
than the tables (the approximation scatter, the interaction heatmap) compute it with
`circuits`, from the same model and SAEs the tables were computed with (checked).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from circuits.bilinear import interaction_matrices
from circuits.sae_basis import input_basis, project
from circuits.spectra import eigh_by_magnitude, lowrank_at
from circuits.weights import from_hooked_transformer
from pipelines.analysis.verdicts import best_candidates, circuit_part, gate_verdicts, negation_candidates
from pipelines.engine.files import read_json
from pipelines.engine.paths import RunPaths
from pipelines.engine.tables import read_table
from sae.activations import iter_activations

TABLES = ("sae_metrics", "lowrank", "eigen", "eigen_inputs", "gates", "gate_truth", "gate_ablation", "interactions",
          "features", "feature_labels")


@dataclass
class ReportData:
    """The run's tables (None where missing) for the chosen layers and circuit part."""

    run: RunPaths
    layers: list[int]
    tables: dict[str, pd.DataFrame | None]
    lm_summary: dict | None
    model_config: dict | None
    verdicts: pd.DataFrame | None = None  # each layer's best candidates
    negation: pd.DataFrame | None = None  # each layer's best candidate labelled a negation gate
    has_ground_truth: bool = False
    notes: list[str] = field(default_factory=list)

    def table(self, name: str) -> pd.DataFrame | None:
        return self.tables.get(name)


def load_report_data(run: RunPaths, layers: list[int], input_site: str, model_dir, n_candidates: int) -> ReportData:
    tables = {}
    for name in TABLES:
        try:
            frame = read_table(run.tables, name, layers)
        except FileNotFoundError:
            frame = None
        tables[name] = circuit_part(frame, input_site)
    summary = read_json(model_dir / "summary.json")
    config = read_json(model_dir / "config.json")
    labels = tables["feature_labels"]
    ground = labels is not None and not labels.empty and {"negation", "context"} <= set(labels["channel"])
    data = ReportData(run, layers, tables, summary, config, has_ground_truth=ground)
    gates = tables["gates"]
    if gates is not None and "layer_rank" in gates:
        data.verdicts = gate_verdicts(best_candidates(gates, n_candidates), tables["gate_ablation"],
                                      tables["features"], labels)
        if ground:
            data.negation = gate_verdicts(negation_candidates(gates, labels), tables["gate_ablation"],
                                          tables["features"], labels)
    return data


@torch.no_grad()
def scatter_points(model, rows, n_rows: int, layer: int, feature: int, saes, ranks: list[int]):
    """For output `feature` of `layer`, over its active held-out tokens: the rank-r
    approximations `[n, len(ranks)]` (`circuits.spectra.lowrank_at`) and activations `[n]`."""
    mlp = from_hooked_transformer(model, layer).to(torch.float64)
    u = saes.sae_out.weights.W_enc.T[feature : feature + 1].double()
    lam, V = eigh_by_magnitude(interaction_matrices(mlp.W_gate, mlp.W_in, mlp.W_out, u))
    approx, acts = [], []
    points = [(layer, "mlp_in"), (layer, "mlp_out")]
    for _, tokens in rows.iter_batches(32, n_rows):
        for found in iter_activations(model, tokens, points, rows.keep(tokens)):
            act = saes.sae_out.weights.encode(found[(layer, "mlp_out")])[:, feature]
            token = (act != 0).nonzero(as_tuple=True)[0]
            if token.numel() == 0:
                continue
            x = found[(layer, "mlp_in")].double()
            cumulative = lowrank_at(x, lam, V, token, torch.zeros_like(token))
            approx.append(cumulative[:, [r - 1 for r in ranks]])
            acts.append(act[token].double())
    if not acts:
        return np.zeros((0, len(ranks))), np.zeros(0)
    return torch.cat(approx).numpy(), torch.cat(acts).numpy()


def interaction_submatrix(model, layer: int, feature: int, saes, inputs: list[int]) -> np.ndarray:
    """`Qt` of one output feature over the given input features (`circuits.sae_basis.project`)."""
    mlp = from_hooked_transformer(model, layer).to(torch.float64)
    w_in = saes.sae_in.weights
    basis = input_basis(w_in.W_dec.double(), w_in.b_dec.double(), mlp.g if saes.input_site == "resid_mid" else None)
    u = saes.sae_out.weights.W_enc.T[feature : feature + 1].double()
    Q = interaction_matrices(mlp.W_gate, mlp.W_in, mlp.W_out, u)[0]
    return project(Q, basis[:, inputs]).numpy()
