"""Write the report: `<run>/report/index.html` and its PNG figures, self-contained.

Sections: the model and corpus (loss in nats and bits per byte), SAE quality, low-rank
correlations per layer, and for every layer its best circuit candidates by `circuit_rank`,
input pairs and group gates, with the verdicts stage's verdicts (`gate_verdicts`), the best
ones in detail: interaction heatmap, spectrum, truth table, ablations and the
approximation scatter (from `lowrank_samples`). Missing tables leave a note in place of
their section. The page links to the explorer when the run has one.
"""

from __future__ import annotations

import re
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import jinja2
import numpy as np
from markupsafe import Markup, escape
import pandas as pd
from tqdm.auto import tqdm

from circuits.sites import INPUT_SITES, OUTPUT_SITE, SITES
from pipelines import summary
from pipelines.analysis.negation import NEGATION_FILE, describe_locus, read_locus
from pipelines.analysis.verdicts import ranking_rule
from pipelines.data.tags import tagged
from pipelines.engine.files import atomic_dir, read_json
from pipelines.engine.paths import INDEX, RunPaths
from pipelines.report import figures
from pipelines.schemas import read
from pipelines.inputs import LayerPlan, LayerSAEs, ModelInputs, check_tables_match
from pipelines.report.config import ReportConfig
from pipelines.report.inputs import (ReportData, interaction_submatrix, load_report_data, scatter_panels,
                                     scatter_samples)

MEMBERS_SHOWN = 8  # input features listed per side of a candidate (the explorer lists them all)
CANDIDATE_COLUMNS = ["circuit_rank", "out_feature", "members_a", "members_b", "label_a", "label_b", "gate_type",
                     "causal_score", "keep_a", "keep_b", "synergy", "gate_score", "and_data", "split_pair", "drop_a",
                     "drop_b", "verdict", "out_description", "a_description", "b_description"]  # and the gate tags


def write_report(run: RunPaths, cfg: ReportConfig, inputs: ModelInputs, plan: dict[int, LayerPlan],
                 processes: int = 1) -> Path:
    """Write the report of the planned layers (see the module docstring); returns the page's path.

    `inputs` is the model the tables were computed with; the plan's SAEs, where they exist,
    are checked against those the tables record. With `processes` > 1 the figures are drawn
    in that many worker processes while the page is put together.
    """
    layers = list(plan)
    data = load_report_data(run, layers, next(iter(plan.values())).input_site, inputs.folder)
    saes = {}
    for layer, mine in plan.items():
        if mine.has_saes():
            saes[layer] = mine.saes(inputs)
            check_tables_match(run, mine)
    steps = tqdm(total=4 + len(layers), desc="report", unit="step")
    with atomic_dir(run.report) as folder, _Pictures(folder, cfg.dpi, processes) as pictures:
        page = {"title": f"Bilinear circuits report: {run.root.resolve().name}", "data": data,
                "model": _model_section(data), "metrics": _metrics(data), "ranking": _code_spans(ranking_rule())}
        steps.update(1)
        page["correlations"] = _correlations(data, pictures, cfg)
        steps.update(1)
        page["layers"] = []
        for layer in layers:
            page["layers"].append(_layer_section(data, layer, pictures, cfg, inputs, saes.get(layer)))
            steps.update(1)
        page["graphs"] = _graphs(run, pictures)
        locus = read_locus(run)
        page["negation"] = {"lines": describe_locus(locus), "file": NEGATION_FILE} if locus else None
        page["explorer"] = run.explorer_page.is_file()
        html = _environment().get_template("report.html").render(**page)
        (folder / INDEX).write_text(html, encoding="utf-8")
        steps.update(2)
    steps.close()
    return run.report_page


class _Pictures:
    """Draws figures (`pipelines.report.figures`) into the report folder and hands back their
    relative paths: in the calling process, or in worker processes side by side (matplotlib
    holds the GIL, so threads would draw one at a time, and drawing is most of a report's
    time). Leaving the block waits for every figure and raises a worker's error."""

    def __init__(self, folder: Path, dpi: int, processes: int = 1):
        self.folder, self.dpi = folder, dpi
        # spawned, not forked: a fork of a process running torch's thread pool may hang
        self.pool = ProcessPoolExecutor(processes, mp_context=get_context("spawn")) if processes > 1 else None
        self.pending: list[Future] = []

    def __enter__(self) -> "_Pictures":
        return self

    def __exit__(self, *failure) -> None:
        if self.pool is None:
            return
        try:
            if failure[0] is None:
                for drawing in self.pending:
                    drawing.result()
        finally:
            self.pool.shutdown(cancel_futures=True)

    def draw(self, name: str, figure, *args) -> str:
        """Draw `figure(*args)` (a function of `figures`) as `name`; returns `name`."""
        if self.pool is None:
            figures.save(self.folder / name, self.dpi, figure, *args)
        else:
            self.pending.append(self.pool.submit(figures.save, self.folder / name, self.dpi, figure, *args))
        return name


def _code_spans(text: str) -> Markup:
    """`text` escaped, its `backquoted` spans as <code>."""
    return Markup(re.sub(r"`([^`]+)`", r"<code>\1</code>", str(escape(text))))


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("pipelines.report", "templates"),
                             autoescape=jinja2.select_autoescape(["html"]))
    env.filters["num"] = _number
    env.filters["pct"] = lambda v: "" if pd.isna(v) else f"{v:.0%}"
    env.filters["share"] = lambda v: "not measured" if v is None or pd.isna(v) else _percent(v)
    env.filters["keeps"] = lambda v: "not ablated" if pd.isna(v) else _percent(1 - v)
    env.filters["label"] = lambda v: "" if v is None or (isinstance(v, float) and np.isnan(v)) else v
    env.filters["members"] = _members
    return env


def _percent(value: float) -> str:
    """A share as a percentage, one decimal under 10% (0.12% is not 0%)."""
    return f"{value:.1%}" if abs(value) < 0.1 else f"{value:.0%}"


def _members(values, shown: int = MEMBERS_SHOWN) -> str:
    """A side's input features, the first `shown` of a long group and how many more."""
    values = list(values)
    more = f" and {len(values) - shown} more" if len(values) > shown else ""
    return _number(values[:shown]) + more


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
    order = metrics.assign(_site=metrics["site"].map(SITES.index))
    return order.sort_values(["layer", "_site"])[summary.METRIC_COLUMNS].to_dict("records")


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
    out = {"by_rank": pictures.draw("correlation_by_rank.png", figures.correlation_by_rank, curves),
           "nan": ", ".join(nan_text), "rank": cfg.hist_rank}
    if any(len(v) for v in values.values()):
        out["histograms"] = pictures.draw(f"rank{cfg.hist_rank}_histograms.png", figures.histograms, values,
                                          nan_counts, cfg.hist_rank)
    return out


def _label(data: ReportData, layer: int, sites: tuple[str, ...], feature: int) -> str:
    features = data.table("features")
    if features is None:
        return f"#{feature}"
    sel = features[(features["layer"] == layer) & features["site"].isin(sites) & (features["feature"] == feature)]
    text = sel["description"].iloc[0] if len(sel) else ""
    return f"#{feature} {text}".strip()


def _layer_section(data: ReportData, layer: int, pictures: _Pictures, cfg: ReportConfig, inputs: ModelInputs,
                   saes: LayerSAEs | None) -> dict:
    section = {"layer": layer, "kinds": [], "cards": []}
    verdicts = data.verdicts
    if verdicts is None or verdicts.empty:
        return section
    mine = verdicts[verdicts["layer"] == layer].sort_values("circuit_rank")
    if mine.empty:  # the verdicts stage has not run for this layer
        return section
    shown = set()
    for kind, title in (("pair", "Input pairs"), ("group", "Group gates")):
        rows = mine[mine["kind"] == kind]
        columns = CANDIDATE_COLUMNS + [tag.column for tag in data.tags]
        section["kinds"].append({"title": title, "rows": rows.head(cfg.n_candidates)[columns].to_dict("records")})
        chosen = [("best", r) for r in rows.head(cfg.cards_per_layer).to_dict("records")]
        for tag in data.tags:
            chosen += [(tag.name, r) for r in tagged(rows, tag).head(1).to_dict("records")]
        for why, row in chosen:
            key = (kind, row["out_feature"], tuple(row["members_a"]), tuple(row["members_b"]))
            if key not in shown:
                shown.add(key)
                section["cards"].append(_card(data, row, why, pictures, cfg, inputs, saes))
    return section


def _card(data: ReportData, row: dict, why: str, pictures: _Pictures, cfg: ReportConfig, inputs: ModelInputs,
          saes: LayerSAEs | None) -> dict:
    layer, f, kind = row["layer"], row["out_feature"], row["kind"]
    name = f"L{layer}_F{f}_{kind}"
    card = {"row": row, "title": f"{kind.capitalize()} circuit rank {row['circuit_rank']} ({why})",
            "out": _label(data, layer, (OUTPUT_SITE,), f), "features": _feature_info(data, layer, f)}
    keys = ("in_a", "in_b") if kind == "pair" else ("group_a", "group_b")
    truth_table, ablation_table = ("gate_truth", "gate_ablation") if kind == "pair" else ("group_truth", "group_ablation")
    match = lambda frame: frame[(frame["layer"] == layer) & (frame["out_feature"] == f)  # noqa: E731
                                & (frame[keys[0]] == row[keys[0]]) & (frame[keys[1]] == row[keys[1]])]
    truth = data.table(truth_table)
    if truth is not None:
        card["truth"] = match(truth)[["cell", "n_tokens", "mean_activation", "active_share"]].to_dict("records")
    ablation = data.table(ablation_table)
    if ablation is not None:
        card["ablation"] = match(ablation)[["ablated", "n_tokens", "activation_before", "activation_after",
                                            "pre_before", "pre_after", "pre_change_predicted", "logprob_before",
                                            "logprob_after"]].to_dict("records")
    eigen = data.table("eigen")
    if eigen is not None:
        sel = eigen[(eigen["layer"] == layer) & (eigen["out_feature"] == f)].sort_values("rank").head(cfg.n_eigen_bars)
        if len(sel):
            card["spectrum"] = pictures.draw(f"{name}_eigen.png", figures.spectrum, sel["rank"].to_numpy(),
                                             sel["eigenvalue"].to_numpy(), f"eigenvalues of Q, layer {layer}, output #{f}")
    if saes is not None:
        inputs_shown = _heatmap_inputs(data, layer, f, list(row["members_a"]) + list(row["members_b"]), cfg.n_inputs)
        matrix = interaction_submatrix(inputs.model, layer, f, saes, inputs_shown)
        labels = [_label(data, layer, INPUT_SITES, i)[:48] for i in inputs_shown]
        card["heatmap"] = pictures.draw(f"{name}_interactions.png", figures.heatmap, matrix, labels,
                                        [f"#{i}" for i in inputs_shown], f"Qt of layer {layer}, output #{f}")
    card["scatter"] = _scatter(data, layer, f, pictures, name)
    return card


def _graphs(run: RunPaths, pictures: _Pictures, most: int = 3) -> list[dict]:
    """A picture of each of the run's first `most` attribution graphs (the pruned graph and its
    strongest token-to-target path), with its scores."""
    nodes, edges = read(run.tables, "graph_nodes"), read(run.tables, "graph_edges")
    if nodes is None or edges is None:
        return []
    out = []
    for prompt in sorted(nodes["prompt"].unique())[:most]:
        mine = nodes[(nodes["prompt"] == prompt) & nodes["kept"]].reset_index(drop=True)
        tokens = mine[mine["kind"] == "token"].sort_values("pos")["token"].tolist()
        at = {node: i for i, node in enumerate(mine["node_id"])}
        links = edges[edges["prompt"] == prompt]
        pairs = np.array([[at[a], at[b]] for a, b in zip(links["source"], links["target"])]).reshape(-1, 2)
        path = mine[mine["path_step"] >= 0].sort_values("path_step").index.tolist()
        meta = read_json(run.graphs / f"{prompt}.json") or {"metadata": {}}
        x = np.where(mine["kind"] == "logit", len(tokens), mine["pos"]).astype(float)
        title = f"{meta['metadata'].get('prompt', prompt)}"
        name = pictures.draw(f"graph_{prompt}.png", figures.attribution_graph, x, mine["viewer_row"].to_numpy() + 1.0,
                             mine["kind"].tolist(), pairs, links["weight"].to_numpy(), path, tokens, title,
                             _node_labels(mine))
        out.append({"prompt": title, "slug": prompt, "picture": name, "path": " -> ".join(mine.loc[path, "description"]),
                    "replacement": meta["metadata"].get("replacement_score"),
                    "completeness": meta["metadata"].get("completeness_score")})
    return out


def _node_labels(nodes: pd.DataFrame) -> list[str]:
    """What the graph figure writes by each node (`graph_nodes` rows): a latent's number, a
    logit's token, nothing for tokens (the axis names them) and error nodes."""
    return [f"#{f}" if kind in ("input", "output") else token if kind == "logit" else ""
            for kind, f, token in zip(nodes["kind"], nodes["feature"], nodes["token"])]


def _feature_info(data: ReportData, layer: int, f: int) -> dict:
    features = data.table("features")
    if features is None:
        return {}
    sel = features[(features["layer"] == layer) & (features["site"] == OUTPUT_SITE) & (features["feature"] == f)]
    if sel.empty:
        return {}
    row = sel.iloc[0]
    return {"boosted": list(row["boosted_tokens"]), "suppressed": list(row["suppressed_tokens"]),
            "contexts": list(row["top_contexts"])[:3]}


def _heatmap_inputs(data: ReportData, layer: int, f: int, first: list[int], n: int) -> list[int]:
    """The candidate's inputs, then the inputs of the output's strongest interactions, `n` in all."""
    chosen = list(dict.fromkeys(int(i) for i in first))[:n]
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


def _scatter(data: ReportData, layer: int, f: int, pictures: _Pictures, name: str) -> str | None:
    """Activation against its rank-r approximations on the sampled tokens of `lowrank_samples`."""
    samples = scatter_samples(data.table("lowrank_samples"), layer, f)
    if samples.empty:
        return None
    panels = scatter_panels(samples)
    n = len(samples) // len(panels)
    title = f"layer {layer}, {_label(data, layer, (OUTPUT_SITE,), f)[:90]} ({n} sampled active tokens)"
    return pictures.draw(f"{name}_scatter.png", figures.scatter, panels, title)
