"""Write the report: `<run>/report/index.html` and its PNG figures, self-contained.

Sections: the model and corpus (loss in nats and bits per byte), SAE quality, low-rank
correlations per layer, and for every layer its best gate candidates ranked by what they
contribute on held-out tokens, with the best ones in detail: interaction heatmap, spectrum,
truth table, ablations and the approximation scatter. Missing tables leave a note in place
of their section. The page links to the explorer when the run has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jinja2
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from circuits.config import Config, option
from pipelines.engine.files import atomic_dir
from pipelines.engine.paths import RunPaths
from pipelines.report import figures
from pipelines.report.inputs import ReportData, interaction_submatrix, load_report_data, scatter_points

INDEX = "index.html"
METRIC_COLUMNS = ["layer", "site", "d_sae", "k", "nmse", "l0", "dead_fraction", "loss_added"]
CANDIDATE_COLUMNS = ["layer_rank", "out_feature", "in_a", "in_b", "gate_score", "contribution_share", "coactivation",
                     "and_data", "and_score", "verdict"]


@dataclass(frozen=True)
class ReportConfig(Config):
    """What the report shows and how much it computes (about a minute on the demo)."""

    n_candidates: int = option(8, "gate candidates per layer in each layer's table", low=1)
    cards_per_layer: int = option(1, "best candidates per layer shown in detail", low=0)
    n_inputs: int = option(8, "input features per interaction heatmap", low=2)
    n_eigen_bars: int = option(16, "largest eigenvalues drawn per spectrum", low=1)
    scatter_rows: int = option(256, "held-out rows run through the model for the scatter plots", low=1)
    hist_rank: int = option(2, "rank whose correlations are histogrammed and quoted", low=1)
    dpi: int = option(100, "resolution of the PNG figures", low=20)


def write_report(run: RunPaths, cfg: ReportConfig, inputs, layers: list[int], store=None,
                 sae_paths: dict | None = None, input_site: str = "resid_mid") -> Path:
    """Write the report of `layers` (see the module docstring); returns the page's path.

    `inputs` is the `pipelines.stages.ModelInputs` the tables were computed with; `store`
    (a token store) feeds the scatter plots; `sae_paths[layer]` are explicit SAEs, checked
    against those the tables record.
    """
    from pipelines.stages import check_tables_match, layer_saes

    data = load_report_data(run, layers, input_site, inputs.folder, cfg.n_candidates)
    saes = {}
    for layer in layers:
        explicit = (sae_paths or {}).get(layer)
        path_in, path_out = explicit or (run.sae(layer, input_site), run.sae(layer, "mlp_out"))
        if Path(path_in).is_dir() and path_out is not None and Path(path_out).is_dir():
            saes[layer] = layer_saes(run, inputs, layer, explicit, input_site, True)
            check_tables_match(run, layer, f"{input_site}-sae", Path(path_in), Path(path_out))
    steps = tqdm(total=4 + len(layers), desc="report", unit="step")
    with atomic_dir(run.report) as folder:
        pictures = _Pictures(folder, cfg.dpi)
        page = {"title": f"Bilinear circuits report: {run.root.resolve().name}", "data": data,
                "model": _model_section(data), "metrics": _metrics(data)}
        steps.update(1)
        page["correlations"] = _correlations(data, pictures, cfg)
        steps.update(1)
        page["layers"] = []
        for layer in layers:
            page["layers"].append(_layer_section(data, layer, pictures, cfg, inputs, store, saes.get(layer)))
            steps.update(1)
        page["explorer"] = (run.explorer / "index.html").is_file()
        html = _environment().get_template("report.html").render(**page)
        (folder / INDEX).write_text(html, encoding="utf-8")
        steps.update(2)
    steps.close()
    return run.report / INDEX


class _Pictures:
    """Saves figures into the report folder and hands back their relative paths."""

    def __init__(self, folder: Path, dpi: int):
        self.folder, self.dpi = folder, dpi

    def save(self, fig: Figure, name: str) -> str:
        fig.savefig(self.folder / name, dpi=self.dpi)
        return name


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("pipelines.report", "templates"),
                             autoescape=jinja2.select_autoescape(["html"]))
    env.filters["num"] = _number
    return env


def _number(value) -> str:
    if isinstance(value, (float, np.floating)):
        return "NaN" if np.isnan(value) else f"{value:.4g}"
    if value is None or value is pd.NA:
        return ""
    if isinstance(value, (list, tuple, np.ndarray)):
        return ", ".join(map(str, value))
    return str(value)


def _model_section(data: ReportData) -> dict:
    summary = data.lm_summary or {}
    return {"config": data.model_config, "summary": summary}


def _metrics(data: ReportData) -> list[dict] | None:
    metrics = data.table("sae_metrics")
    if metrics is None:
        return None
    order = metrics.assign(_site=metrics["site"].map({"resid_mid": 0, "mlp_in": 1, "mlp_out": 2}))
    return order.sort_values(["layer", "_site"])[METRIC_COLUMNS].to_dict("records")


def _correlations(data: ReportData, pictures: _Pictures, cfg: ReportConfig) -> dict | None:
    lowrank = data.table("lowrank")
    if lowrank is None or lowrank.empty:
        return None
    curves, values, nan_counts, nan_text = {}, {}, {}, []
    for layer, df in lowrank.groupby("layer"):
        mean = df.groupby("n_eigs")["corr_active"].mean()
        curves[layer] = (mean.index.to_numpy(), mean.to_numpy())
        at_r = df.loc[df["n_eigs"] == cfg.hist_rank, "corr_active"]
        values[layer] = at_r.dropna().to_numpy()
        nan_counts[layer] = int(at_r.isna().sum())
        nan_text.append(f"layer {layer}: {df.loc[df['corr_active'].isna(), 'out_feature'].nunique()} "
                        f"of {df['out_feature'].nunique()}")
    out = {"by_rank": pictures.save(figures.correlation_by_rank(curves), "correlation_by_rank.png"),
           "nan": ", ".join(nan_text), "rank": cfg.hist_rank}
    if any(len(v) for v in values.values()):
        out["histograms"] = pictures.save(figures.histograms(values, nan_counts, cfg.hist_rank),
                                          f"rank{cfg.hist_rank}_histograms.png")
    return out


def _label(data: ReportData, layer: int, sites: tuple[str, ...], feature: int) -> str:
    features = data.table("features")
    if features is None:
        return f"#{feature}"
    sel = features[(features["layer"] == layer) & features["site"].isin(sites) & (features["feature"] == feature)]
    text = sel["description"].iloc[0] if len(sel) else ""
    return f"#{feature} {text}".strip()


def _layer_section(data: ReportData, layer: int, pictures: _Pictures, cfg: ReportConfig, inputs, store, saes) -> dict:
    section = {"layer": layer, "candidates": None, "cards": []}
    verdicts = data.verdicts
    if verdicts is None or verdicts.empty:
        return section
    mine = verdicts[verdicts["layer"] == layer].sort_values("layer_rank")
    if mine.empty:
        return section
    section["candidates"] = [
        {**{c: row[c] for c in CANDIDATE_COLUMNS}, "negation_gate": row["negation_gate"],
         "out": row["out_description"], "a": row["a_description"], "b": row["b_description"]}
        for row in mine.to_dict("records")
    ]
    for row in mine.head(cfg.cards_per_layer).to_dict("records"):
        section["cards"].append(_card(data, row, pictures, cfg, inputs, store, saes))
    if data.negation is not None and len(data.negation):
        for row in data.negation[data.negation["layer"] == layer].to_dict("records"):
            card = _card(data, row, pictures, cfg, inputs, store, saes)
            card["title"] = "Negation gate candidate"
            section["cards"].append(card)
    return section


def _card(data: ReportData, row: dict, pictures: _Pictures, cfg: ReportConfig, inputs, store, saes) -> dict:
    layer, f, a, b = row["layer"], row["out_feature"], row["in_a"], row["in_b"]
    name = f"L{layer}_F{f}"
    card = {"row": row, "title": f"Data rank {row['layer_rank']}", "out": _label(data, layer, ("mlp_out",), f),
            "a": _label(data, layer, ("resid_mid", "mlp_in"), a), "b": _label(data, layer, ("resid_mid", "mlp_in"), b),
            "features": _feature_info(data, layer, f)}
    truth = data.table("gate_truth")
    if truth is not None:
        sel = truth[(truth["layer"] == layer) & (truth["out_feature"] == f) & (truth["in_a"] == a) & (truth["in_b"] == b)]
        card["truth"] = sel[["cell", "n_tokens", "mean_activation", "active_share", "quantile_activation"]].to_dict("records")
    ablation = data.table("gate_ablation")
    if ablation is not None:
        sel = ablation[(ablation["layer"] == layer) & (ablation["out_feature"] == f) & (ablation["in_a"] == a)
                       & (ablation["in_b"] == b)]
        card["ablation"] = sel.drop(columns=["layer", "out_feature", "in_a", "in_b", "layer_rank", "outputs",
                                             "input_site"]).to_dict("records")
    eigen = data.table("eigen")
    if eigen is not None:
        sel = eigen[(eigen["layer"] == layer) & (eigen["out_feature"] == f)].sort_values("rank").head(cfg.n_eigen_bars)
        if len(sel):
            card["spectrum"] = pictures.save(figures.spectrum(sel["rank"].to_numpy(), sel["eigenvalue"].to_numpy(),
                                                              f"eigenvalues of Q, layer {layer}, output #{f}"),
                                             f"{name}_eigen.png")
    if saes is not None:
        inputs_shown = _heatmap_inputs(data, layer, f, a, b, cfg.n_inputs)
        matrix = interaction_submatrix(inputs.model, layer, f, saes, inputs_shown)
        labels = [_label(data, layer, ("resid_mid", "mlp_in"), i)[:48] for i in inputs_shown]
        card["heatmap"] = pictures.save(figures.heatmap(matrix, labels, [f"#{i}" for i in inputs_shown],
                                                        f"Qt of layer {layer}, output #{f}"), f"{name}_interactions.png")
        if store is not None:
            card["scatter"] = _scatter(data, layer, f, pictures, cfg, inputs, store, saes, name)
    return card


def _feature_info(data: ReportData, layer: int, f: int) -> dict:
    features = data.table("features")
    if features is None:
        return {}
    sel = features[(features["layer"] == layer) & (features["site"] == "mlp_out") & (features["feature"] == f)]
    if sel.empty:
        return {}
    row = sel.iloc[0]
    return {"boosted": list(row["boosted_tokens"]), "suppressed": list(row["suppressed_tokens"]),
            "contexts": list(row["top_contexts"])[:3]}


def _heatmap_inputs(data: ReportData, layer: int, f: int, a: int, b: int, n: int) -> list[int]:
    """The pair, then the inputs of the output's strongest interactions, `n` in all."""
    chosen = [a, b]
    table = data.table("interactions")
    if table is not None:
        rows = table[(table["layer"] == layer) & (table["out_feature"] == f)]
        rows = rows.reindex(rows["coefficient"].abs().sort_values(ascending=False).index)
        for index in rows[["in_a", "in_b"]].to_numpy().ravel():
            if len(chosen) >= n:
                break
            if index >= 0 and index not in chosen:
                chosen.append(int(index))
    return chosen


def _scatter(data: ReportData, layer: int, f: int, pictures: _Pictures, cfg: ReportConfig, inputs, store, saes,
             name: str) -> str | None:
    d = inputs.config.d_model
    ranks = sorted({r for r in (1, cfg.hist_rank) if r < d}) + [d]
    approx, acts = scatter_points(inputs.model, store.held_out, cfg.scatter_rows, layer, f, saes, ranks)
    if len(acts) < 2:
        return None
    panels = []
    for column, r in enumerate(ranks):
        x = approx[:, column]
        corr = float(np.corrcoef(x, acts)[0, 1]) if x.std() > 0 and acts.std() > 0 else float("nan")
        panels.append((f"full rank ({r})" if r == d else f"rank {r}", x, acts, corr))
    title = f"layer {layer}, {_label(data, layer, ('mlp_out',), f)[:90]} ({len(acts)} active tokens)"
    return pictures.save(figures.scatter(panels, title), f"{name}_scatter.png")
