"""One output feature of a layer: its circuit tables' rows, with the features' descriptions
joined, and figures for a notebook."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from circuits.sites import OUTPUT_SITE

# columns naming a feature, the column their description goes to, and which SAE they index
# (None: the input SAE of the table's input site)
DESCRIBED = {"out_feature": ("out_description", OUTPUT_SITE), "in_a": ("a_description", None),
             "in_b": ("b_description", None), "in_feature": ("in_description", None)}
CONSTANT = "(the constant coordinate: b_dec and the linear terms)"


def with_descriptions(frame: pd.DataFrame, features: pd.DataFrame | None, input_site: str) -> pd.DataFrame:
    """`frame` with a description column beside each column that names a feature (`DESCRIBED`)
    and has none yet, read from the run's `features` table (`features`); the input side's
    constant coordinate (index -1) is described as such."""
    if features is None or frame.empty or "description" not in features.columns:
        return frame
    text = features.set_index(["layer", "site", "feature"])["description"]
    text = text[~text.index.duplicated()]
    out = frame.copy()
    for column, (name, site) in DESCRIBED.items():
        if column not in out.columns or name in out.columns:
            continue
        sites = out["input_site"] if site is None and "input_site" in out.columns else (site or input_site)
        keys = pd.MultiIndex.from_arrays([out["layer"].to_numpy(), np.broadcast_to(np.asarray(sites, dtype=object),
                                                                                    len(out)),
                                          out[column].to_numpy(dtype=np.int64)])
        described = text.reindex(keys).to_numpy()
        out.insert(out.columns.get_loc(column) + 1, name,
                   np.where(out[column].to_numpy() == -1, CONSTANT, described))
    return out


class Feature:
    """One output feature (an mlp_out SAE latent) of one layer, and how the layer's bilinear MLP
    builds it from the input SAE's features.

    Each table property holds this feature's rows of the run's table of that name (or of the
    same table computed for this feature alone), with the features' descriptions joined; a table
    the run does not have is None. Coefficients are those of `z'^T Qt z'`, the MLP's output
    along the feature's encoder row as a quadratic form in the input SAE's latents (see the
    concepts pages of the documentation).
    """

    def __init__(self, layer: int, feature: int, input_site: str, tables: dict[str, pd.DataFrame | None],
                 features: pd.DataFrame | None = None,
                 submatrix: Callable[[list[int]], np.ndarray] | None = None):
        self.layer = layer
        self.feature = feature
        self.input_site = input_site
        self._tables = tables
        self._features = features
        self._submatrix = submatrix

    def __repr__(self) -> str:
        return f"Feature(layer={self.layer}, feature={self.feature}, description={self.description!r})"

    def table(self, name: str) -> pd.DataFrame | None:
        """This feature's rows of table `name` (any circuit or verdicts table), descriptions joined."""
        frame = self._tables.get(name)
        return None if frame is None else with_descriptions(frame.reset_index(drop=True), self._features,
                                                            self.input_site)

    # ------------------------------------------------------------------ what it is

    def _row(self) -> dict | None:
        if self._features is None:
            return None
        f = self._features
        mine = f[(f["layer"] == self.layer) & (f["site"] == OUTPUT_SITE) & (f["feature"] == self.feature)]
        return None if mine.empty else mine.iloc[0].to_dict()

    @property
    def description(self) -> str | None:
        """The feature's one-line description (None without a `features` table)."""
        row = self._row()
        return None if row is None else row["description"]

    @property
    def contexts(self) -> list[str]:
        """Its top-activating contexts, the active token in brackets (empty without a `features` table)."""
        row = self._row()
        return [] if row is None or row.get("top_contexts") is None else [str(c) for c in row["top_contexts"]]

    # ------------------------------------------------------------------ its circuit

    @property
    def interactions(self) -> pd.DataFrame | None:
        """Its top terms (`self`, `cross`, `linear`, `constant`), strongest |coefficient| first."""
        frame = self.table("interactions")
        if frame is None:
            return None
        return frame.iloc[frame["coefficient"].abs().argsort()[::-1]].reset_index(drop=True)

    def top_interactions(self, n: int = 10, kinds: tuple[str, ...] = ("cross", "self")) -> pd.DataFrame | None:
        """The `n` strongest terms of the given kinds (by default the products of two inputs,
        `cross`, and of one with itself, `self`; `interactions` also holds each input's `linear`
        term and the `constant`): kind, the two inputs with their descriptions, coefficient."""
        frame = self.interactions
        if frame is None:
            return None
        frame = frame[frame["kind"].isin(kinds)]
        shown = [c for c in ("kind", "in_a", "a_description", "in_b", "b_description", "coefficient") if c in frame]
        return frame[shown].head(n).reset_index(drop=True)

    @property
    def spectrum(self) -> pd.DataFrame | None:
        """The eigenvalues of its interaction matrix by |eigenvalue|, each with its share of the
        spectrum's energy and of the activation on active tokens."""
        frame = self.table("eigen")
        return None if frame is None else frame.sort_values("rank").reset_index(drop=True)

    @property
    def eigenvalues(self) -> np.ndarray:
        """The stored eigenvalues, largest |eigenvalue| first."""
        spectrum = self.spectrum
        return np.zeros(0) if spectrum is None else spectrum["eigenvalue"].to_numpy()

    @property
    def eigen_reads(self) -> pd.DataFrame | None:
        """What each top eigenvector reads: the input features whose MLP-input directions it is
        closest to, by |cosine|, with their descriptions."""
        frame = self.table("eigen_inputs")
        return None if frame is None else frame.sort_values(["eigen_rank", "input_rank"]).reset_index(drop=True)

    @property
    def lowrank(self) -> pd.DataFrame | None:
        """The active-only correlation of each rank-r approximation with the activation."""
        frame = self.table("lowrank")
        return None if frame is None else frame.sort_values("n_eigs").reset_index(drop=True)

    def correlation(self, rank: int = 2) -> float:
        """The active-only correlation of its rank-`rank` approximation (NaN when too few
        tokens activate it)."""
        frame = self.lowrank
        if frame is None:
            raise ValueError(f"feature {self.feature} of layer {self.layer} has no low-rank correlations: they need "
                             "tokens")
        row = frame[frame["n_eigs"] == rank]
        if row.empty:
            raise ValueError(f"rank must lie in 1..{int(frame['n_eigs'].max())}, got {rank}")
        return float(row["corr_active"].iloc[0])

    @property
    def gates(self) -> pd.DataFrame | None:
        """Its candidate AND-gate pairs (`gates`): weight terms and, on tokens, what each pair
        contributes, by weight rank."""
        frame = self.table("gates")
        return None if frame is None else frame.sort_values("weight_rank").reset_index(drop=True)

    @property
    def pair_gates(self) -> pd.DataFrame | None:
        """Its candidate pairs tested by intervention, with their gate types (`pair_gates`; None
        unless the verdicts stage has run or the feature was judged alone)."""
        return self.table("pair_gates")

    @property
    def group_gates(self) -> pd.DataFrame | None:
        """Its gates between two groups of inputs, with their types (`group_gates`; None unless the
        verdicts stage has run or the feature was judged alone)."""
        return self.table("group_gates")

    @property
    def verdicts(self) -> pd.DataFrame | None:
        """Its circuit candidates with their verdicts (`gate_verdicts`; None unless the verdicts
        stage has run or the feature was judged alone)."""
        frame = self.table("gate_verdicts")
        return None if frame is None else frame.sort_values("circuit_rank").reset_index(drop=True)

    # ------------------------------------------------------------------ figures

    def spectrum_figure(self, n: int = 16):
        """A matplotlib `Figure`: the `n` largest eigenvalues by rank."""
        from pipelines.report import figures

        spectrum = self._need(self.spectrum, "eigen").head(n)
        return figures.spectrum(spectrum["rank"].to_numpy(), spectrum["eigenvalue"].to_numpy(),
                                f"eigenvalues of Q, layer {self.layer}, output #{self.feature}")

    def interactions_figure(self, n: int = 8):
        """A matplotlib `Figure`: `Qt` over the inputs of its `n` strongest interactions."""
        from pipelines.report import figures

        if self._submatrix is None:
            raise ValueError("this feature was read from tables alone: open its run with its model and SAEs to draw "
                             "its interaction matrix")
        frame = self._need(self.interactions, "interactions")
        chosen = list(dict.fromkeys(int(i) for i in frame[["in_a", "in_b"]].to_numpy().ravel() if i >= 0))[:n]
        labels = [self._input_label(i) for i in chosen]
        return figures.heatmap(self._submatrix(chosen), labels, [f"#{i}" for i in chosen],
                               f"Qt of layer {self.layer}, output #{self.feature}")

    def scatter_figure(self):
        """A matplotlib `Figure`: the activation against its low-rank approximations on the
        sampled active tokens, one panel per rank shown."""
        from pipelines.report import figures
        from pipelines.report.inputs import scatter_panels, scatter_samples

        samples = self._need(self.table("lowrank_samples"), "lowrank_samples")
        panels = scatter_panels(scatter_samples(samples, self.layer, self.feature))
        if not panels:
            raise ValueError(f"feature {self.feature} of layer {self.layer} has no sampled active tokens")
        return figures.scatter(panels, f"layer {self.layer}, output #{self.feature}: {self.description or ''}"[:100])

    def _input_label(self, index: int) -> str:
        if self._features is None:
            return f"#{index}"
        f = self._features
        mine = f[(f["layer"] == self.layer) & (f["site"] == self.input_site) & (f["feature"] == index)]
        return f"#{index}" if mine.empty else f"#{index} {mine['description'].iloc[0]}"[:48]

    def _need(self, frame: pd.DataFrame | None, name: str) -> pd.DataFrame:
        if frame is None or frame.empty:
            raise ValueError(f"feature {self.feature} of layer {self.layer} has no {name} rows")
        return frame
