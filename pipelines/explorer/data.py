"""What the explorer shows: a run's tables, read once and written as compact JSON.

Every data file is a line of JavaScript that registers one JSON value,

    (window.BCX_DATA = window.BCX_DATA || {})["<name>"] = <JSON>;

so that a page opened from file:// loads it with a <script> element (browsers refuse
fetch() there). The files (`data/<name>.js`):

- `meta`: the run's name, layers, input sites (and the default one), the output site,
  which tables are present (and why the others are not), the number of features per
  (layer, site), SAE metrics, the mean low-rank correlation per rank, HOSVD singular values
  and the gate tags the verdicts carry (`pipelines.data.tags`).
- `index`: one row per output feature (site mlp_out) of every layer: description,
  frequency, top tokens; and per input site the summary numbers of each row (rank-2
  correlation, its circuit candidate pair and best group gate with their circuit ranks, the
  top eigenvalue's energy share).
- `features_L<l>`: the `features` and `feature_labels` rows of layer l, every site.
- `circuits_L<l>_<site>`: the circuit tables of layer l whose input SAE reads `site`, for
  the output SAE's features (`outputs == "sae"`): interactions, gates and the truth tables the
  pages show (each output's best pair and its circuit candidate), eigen, eigen_inputs,
  lowrank, group gates and their truth tables, and the ablations.
- `verdicts_L<l>_<site>`: the `gate_verdicts` rows (as the verdicts stage wrote them), for
  the layer page and the feature pages.
- `samples_L<l>_<site>`: `lowrank_samples` (the rows `pipelines.report.inputs.scatter_samples`
  picks, as the report's scatter), in a file of its own: only a scatter plot needs it.

A table is `{"n": rows, "columns": {name: [values]}, "categories": {name: [labels]}}`; a
column named in "categories" holds integer codes into its labels (-1 for null). Floats
are rounded to `DIGITS` significant digits; NaN and infinities are written as null. A
table the run lacks is null, and `meta.missing` says why.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa

from circuits.sites import DEFAULT_INPUT_SITE, INPUT_SITES, OUTPUT_SITE
from pipelines.data.tags import present_tags
from pipelines.engine.paths import RunPaths
from pipelines.graph.export import read_index
from pipelines.graph.serve import viewer_path
from pipelines.engine.tables import read_table
from pipelines.report.inputs import scatter_samples
from pipelines.schemas import GATE_TAGS, TABLES, select

DIGITS = 4
CORR_RANK = 2  # the rank whose low-rank correlation the index shows (or the largest below it)

# which data file each table of a layer and input site goes into (the columns, their order,
# the rows' order and which columns are coded come from the registry, `pipelines.schemas`)
FILES = {
    "circuits": ("interactions", "gates", "gate_truth", "eigen", "eigen_inputs", "lowrank", "group_gates",
                 "group_truth", "gate_ablation", "group_ablation"),
    "verdicts": ("gate_verdicts",),
    "samples": ("lowrank_samples",),
}
LAYER_TABLES = tuple(name for names in FILES.values() for name in names)
OTHER_TABLES = ("features", "feature_labels", "sae_metrics", "hosvd")
PER_LAYER = ("layer", "outputs", "input_site")  # the same on every row of a per-layer file: left out
LEFT_OUT = {"gate_verdicts": ("out_description", "a_description", "b_description"),  # the page has the features
            "features": ("layer",), "feature_labels": ("layer", "lift"),
            # the weight terms and cell counts the gate list does not show (the truth tables have the cells):
            # a sixth of the explorer on the demo, which must stay under 50 MB
            "gates": ("cross", "self_a", "self_b", "mean_contribution", "n_both", "n_a_only", "n_b_only")}


# ------------------------------------------------------------------ encoding


def round_sig(values, digits: int = DIGITS) -> np.ndarray:
    """`values` rounded to `digits` significant digits (NaN and infinities kept)."""
    x = np.array(values, dtype=np.float64, copy=True).reshape(-1)
    ok = np.isfinite(x) & (np.abs(x) > 1e-290)  # zero and the tiniest values are written as they are
    v = x[ok]
    if v.size:
        shift = digits - 1 - np.floor(np.log10(np.abs(v))).astype(np.int64)
        out = np.empty_like(v)
        up = shift >= 0  # divide by an exact power of ten: the result prints as its short decimal
        out[up] = np.round(v[up] * 10.0 ** shift[up]) / 10.0 ** shift[up]
        out[~up] = np.round(v[~up] / 10.0 ** -shift[~up]) * 10.0 ** -shift[~up]
        x[ok] = out
    return x


def _floats(values, digits: int = DIGITS) -> list:
    """Rounded floats for JSON: whole numbers written as integers (shorter), NaN as null."""
    return [(int(v) if v.is_integer() and abs(v) < 1e15 else v) if math.isfinite(v) else None
            for v in round_sig(values, digits).tolist()]


def _is_list_column(series: pd.Series) -> bool:
    sample = series.dropna()
    return len(sample) > 0 and isinstance(sample.iloc[0], (list, tuple, np.ndarray))


def encode_column(series: pd.Series, categorical: bool = False) -> tuple[list, list | None]:
    """A column as a JSON-ready list (and its category labels when coded)."""
    if categorical:
        codes, labels = pd.factorize(series.astype(object), use_na_sentinel=True)
        return codes.tolist(), [str(v) for v in labels]
    dtype = series.dtype
    if pd.api.types.is_bool_dtype(dtype):
        return [None if pd.isna(v) else bool(v) for v in series.astype(object)], None
    if pd.api.types.is_integer_dtype(dtype):
        if series.isna().any():
            return [None if pd.isna(v) else int(v) for v in series.astype(object)], None
        return series.to_numpy(dtype=np.int64).tolist(), None
    if pd.api.types.is_float_dtype(dtype):
        return _floats(series.to_numpy(dtype=np.float64, na_value=np.nan)), None
    if _is_list_column(series):
        out = []
        for v in series:
            if v is None or (not isinstance(v, (list, tuple, np.ndarray)) and pd.isna(v)):
                out.append([])
                continue
            items = list(v)
            if items and all(isinstance(i, (float, np.floating)) for i in items):
                out.append(_floats(items))
            elif items and all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in items):
                out.append([int(i) for i in items])
            else:
                out.append([None if i is None else str(i) for i in items])
        return out, None
    return [_scalar(v) for v in series.astype(object)], None


def _scalar(value):
    """One value of an object column as JSON: null, a bool, a number or a string."""
    if value is None or value is pd.NA:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return _floats([value])[0]
    return str(value)


def encode_table(df: pd.DataFrame | None, columns: list[str] | None = None, categories=()) -> dict | None:
    """`df` (its `columns`, those present) as a columnar table; None stays None."""
    if df is None:
        return None
    columns = [c for c in (columns or list(df.columns)) if c in df.columns]
    table = {"n": len(df), "columns": {}, "categories": {}}
    for c in columns:
        values, labels = encode_column(df[c], c in categories)
        table["columns"][c] = values
        if labels is not None:
            table["categories"][c] = labels
    return table


def decode_table(table: dict | None) -> pd.DataFrame | None:
    """The inverse of `encode_table` (for tests and tools): a data frame of the JSON values
    as they are (object columns, nulls as None)."""
    if table is None:
        return None
    data = {}
    for c, values in table["columns"].items():
        labels = table["categories"].get(c)
        values = [None if v < 0 else labels[v] for v in values] if labels is not None else values
        data[c] = pd.Series(values, dtype=object, index=range(table["n"]))
    return pd.DataFrame(data, index=range(table["n"]))


def script(name: str, value) -> str:
    """The JavaScript of data file `name`: registers `value` (JSON) under BCX_DATA[name]."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    text = text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return f"(window.BCX_DATA=window.BCX_DATA||{{}})[{json.dumps(name)}]={text};\n"


def parse_script(text: str):
    """The JSON value a data file registers (the inverse of `script`)."""
    head, _, body = text.partition("]=")
    if not head.startswith("(window.BCX_DATA"):
        raise ValueError("not an explorer data file")
    return json.loads(body.rstrip().removesuffix(";"))


# ------------------------------------------------------------------ reading the run


@dataclass
class RunTables:
    """The run's tables (restricted to SAE outputs), and why each absent one is absent."""

    frames: dict[str, pd.DataFrame] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> pd.DataFrame | None:
        return self.frames.get(name)


def load_tables(run: RunPaths) -> RunTables:
    out = RunTables()
    for name in (*LAYER_TABLES, *OTHER_TABLES):
        try:
            df = read_table(run.tables, name)
        except FileNotFoundError:
            out.missing[name] = "not in this run"
            continue
        except (OSError, pa.ArrowException, ValueError) as error:
            out.missing[name] = f"unreadable ({type(error).__name__}: {error})"
            continue
        lacking = [c for c in TABLES[name].names if c not in df.columns]
        if lacking:
            out.missing[name] = f"lacks columns {', '.join(lacking)}"
            continue
        if name in LAYER_TABLES:
            df = select(df, input_site=None)
            if df.empty:
                out.missing[name] = "no rows for the output SAE's features"
                continue
        out.frames[name] = df
    return out


def input_sites(tables: RunTables) -> list[str]:
    """Input sites of the circuit tables, the preferred (resid_mid) first."""
    found = set()
    for name in LAYER_TABLES:
        df = tables.get(name)
        if df is not None and "input_site" in df.columns:
            found |= {str(s) for s in df["input_site"].dropna().unique()}
    if not found and any(tables.get(n) is not None for n in LAYER_TABLES):
        found = {INPUT_SITES[0]}
    order = {s: i for i, s in enumerate(INPUT_SITES)}
    return sorted(found, key=lambda s: (order.get(s, len(order)), s))


def run_layers(tables: RunTables) -> list[int]:
    layers = set()
    for df in tables.frames.values():
        if "layer" in df.columns:
            layers |= {int(v) for v in df["layer"].dropna().unique()}
    return sorted(layers)


def feature_counts(tables: RunTables, sites: list[str]) -> dict[tuple[int, str], int]:
    """Features per (layer, site): the SAE's width, and never fewer than the ids the tables use."""
    counts: dict[tuple[int, str], int] = {}

    def grow(layer, site, n):
        key = (int(layer), str(site))
        counts[key] = max(counts.get(key, 0), int(n))

    metrics = tables.get("sae_metrics")
    if metrics is not None and "d_sae" in metrics.columns:
        for r in metrics[["layer", "site", "d_sae"]].dropna().itertuples(index=False):
            grow(r.layer, r.site, r.d_sae)
    features = tables.get("features")
    if features is not None:
        for (layer, site), n in features.groupby(["layer", "site"])["feature"].max().items():
            grow(layer, site, n + 1)
    for name in LAYER_TABLES:
        df = tables.get(name)
        if df is None:
            continue
        for layer, n in df.groupby("layer")["out_feature"].max().items():
            grow(layer, OUTPUT_SITE, n + 1)
        for site in sites:
            mine = select(df, site, None)
            if mine.empty:
                continue
            for column in ("in_a", "in_b", "in_feature", "members_a", "members_b"):
                if column not in mine.columns:
                    continue
                ids = mine[["layer", column]].explode(column) if column.startswith("members") else mine[["layer", column]]
                ids = ids.assign(**{column: pd.to_numeric(ids[column], errors="coerce")}).dropna()
                for layer, n in ids.groupby("layer")[column].max().items():
                    if n >= 0:  # -1: the constant coordinate
                        grow(layer, site, n + 1)
    return counts


# ------------------------------------------------------------------ the bundles


def _top_tokens_text(features: pd.DataFrame) -> list[str]:
    """Per row, its distinct top tokens (and top token) as one string, for searching."""
    out = []
    for tokens, top in zip(features["top_tokens"] if "top_tokens" in features else [None] * len(features),
                           features["top_token"] if "top_token" in features else [None] * len(features)):
        seen = []
        for t in ([top] if isinstance(top, str) else []) + (list(tokens) if tokens is not None else []):
            if isinstance(t, str) and t not in seen:
                seen.append(t)
        out.append(" ".join(seen))
    return out


def corr_rank(lowrank: pd.DataFrame | None) -> int:
    if lowrank is None or lowrank.empty:
        return CORR_RANK
    ranks = sorted(int(r) for r in lowrank["n_eigs"].unique())
    below = [r for r in ranks if r <= CORR_RANK]
    return below[-1] if below else ranks[0]


RANKED_SHOWN = 5  # candidates of each kind per layer on the explorer's first page
SIDE_TEXT = 40  # characters of an input's description shown beside it there


def index_bundle(tables: RunTables, layers: list[int], sites: list[str], counts: dict) -> dict:
    """One row per output feature of every layer, with its summary numbers per input site."""
    keys = [(layer, f) for layer in layers for f in range(counts.get((layer, OUTPUT_SITE), 0))]
    base = pd.DataFrame(keys, columns=["layer", "feature"]).astype(np.int64)
    features = tables.get("features")
    if features is not None:
        mine = features[features["site"] == OUTPUT_SITE].drop_duplicates(["layer", "feature"])
        mine = mine.assign(top_tokens_text=_top_tokens_text(mine))
        cols = [c for c in ("description", "frequency", "top_token", "top_tokens_text") if c in mine.columns]
        base = base.merge(mine[["layer", "feature", *cols]], on=["layer", "feature"], how="left")
    rank = corr_rank(tables.get("lowrank"))
    stats, inputs = {}, {}
    for site in sites:
        shown = []  # each kind's best candidates per layer, as the first page lists them
        frame = base[["layer", "feature"]]
        lowrank = select(tables.get("lowrank"), site)
        if lowrank is not None:
            sel = lowrank[lowrank["n_eigs"] == rank].drop_duplicates(["layer", "out_feature"])
            frame = frame.merge(sel[["layer", "out_feature", "corr_active", "n_active"]]
                                .rename(columns={"out_feature": "feature", "corr_active": "corr"}),
                                on=["layer", "feature"], how="left")
        verdicts = select(tables.get("gate_verdicts"), site)
        if verdicts is not None:
            for kind, prefix in (("pair", "gate"), ("group", "group")):
                # an output's candidate; split pairs that outscore it come after it by circuit_rank
                best = verdicts[verdicts["kind"] == kind].sort_values("circuit_rank").drop_duplicates(
                    ["layer", "out_feature"])
                best = best[["layer", "out_feature", "circuit_rank", "gate_type", "causal_score", "contribution_share",
                             "and_data", "coactivation", "split_pair", "members_a", "members_b"]].rename(columns={
                    "out_feature": "feature", "circuit_rank": f"{prefix}_rank", "gate_type": f"{prefix}_type",
                    "causal_score": f"{prefix}_causal", "contribution_share": f"{prefix}_share",
                    "and_data": f"{prefix}_and_data", "coactivation": f"{prefix}_coactivation",
                    "split_pair": f"{prefix}_split", "members_a": f"{prefix}_a", "members_b": f"{prefix}_b"})
                frame = frame.merge(best, on=["layer", "feature"], how="left")
                frame[f"{prefix}_rank"] = frame[f"{prefix}_rank"].astype("Int64")
                shown.append(best.sort_values(f"{prefix}_rank").groupby("layer").head(RANKED_SHOWN))
        eigen = select(tables.get("eigen"), site)
        if eigen is not None:
            top = eigen[eigen["rank"] == 1].drop_duplicates(["layer", "out_feature"])
            frame = frame.merge(top[["layer", "out_feature", "eigenvalue", "energy_share"]]
                                .rename(columns={"out_feature": "feature", "eigenvalue": "eig1",
                                                 "energy_share": "energy1"}),
                                on=["layer", "feature"], how="left")
        if "n_active" in frame.columns:
            frame["n_active"] = frame["n_active"].astype("Int64")
        stats[site] = encode_table(frame.drop(columns=["layer", "feature"]))
        inputs[site] = encode_table(_side_descriptions(shown, features, site))
    return {"features": encode_table(base), "stats": stats, "corr_rank": rank, "inputs": inputs,
            "ranked_shown": RANKED_SHOWN}


def _side_descriptions(shown: list[pd.DataFrame], features: pd.DataFrame | None, site: str) -> pd.DataFrame | None:
    """Layer, feature and short description of every input feature on a side of the candidates
    the first page shows (`shown`: their rows, with `<prefix>_a`/`<prefix>_b` member lists)."""
    if features is None or not shown:
        return None
    members = set()
    for rows in shown:
        sides = [c for c in rows.columns if c.endswith(("_a", "_b"))]
        for layer, *lists in rows[["layer", *sides]].itertuples(index=False):
            members |= {(int(layer), int(m)) for side in lists if side is not None for m in side if m >= 0}
    mine = features[features["site"] == site].drop_duplicates(["layer", "feature"])
    keys = pd.DataFrame(sorted(members), columns=["layer", "feature"]).astype(np.int64)
    found = keys.merge(mine[["layer", "feature", "description"]], on=["layer", "feature"], how="inner")
    return found.assign(description=found["description"].map(lambda d: d if len(str(d)) <= SIDE_TEXT
                                                                else str(d)[:SIDE_TEXT - 1] + "…"))


def _export(df: pd.DataFrame, name: str) -> dict | None:
    """Rows of table `name` in the registry's order, its columns but those a file leaves out."""
    spec = TABLES[name]
    drop = set(PER_LAYER) | set(LEFT_OUT.get(name, ()))
    order = [c for c in spec.sort if c in df.columns]
    rows = df.sort_values(order, kind="stable") if order else df
    return encode_table(rows, [c for c in spec.schema_with(df.columns).names if c not in drop], spec.categories)


def features_bundle(tables: RunTables, layer: int) -> dict:
    out = {}
    for name in ("features", "feature_labels"):
        df = tables.get(name)
        out[name] = None if df is None else _export(df[df["layer"] == layer], name)
    return out


def data_bundle(tables: RunTables, layer: int, site: str, file: str) -> dict:
    """The tables of data file `file` (see `FILES`) for one layer and input site."""
    out = {}
    for name in FILES[file]:
        df = select(tables.get(name), site)
        if df is None:
            out[name] = None
            continue
        mine = df[df["layer"] == layer]
        if name == "gate_verdicts" and mine.empty:  # verdicts not run for this layer: none, not an empty table
            out[name] = None
            continue
        if name == "gate_truth":  # only the truth tables the pages show: of the verdicts' pairs and the best
            mine = _shown_truth(mine, select(tables.get("gate_verdicts"), site), layer)
        if name == "lowrank_samples":
            mine = scatter_samples(mine, layer) if len(mine) else mine
        out[name] = _export(mine, name)
    return out


def _shown_truth(truth: pd.DataFrame, verdicts: pd.DataFrame | None, layer: int) -> pd.DataFrame:
    """The gate_truth rows of each output's best data-ranked pair and of its circuit candidate."""
    keys = ["out_feature", "in_a", "in_b"]
    keep = truth["layer_rank"].notna()
    if verdicts is not None:
        pairs = verdicts[(verdicts["layer"] == layer) & (verdicts["kind"] == "pair")][keys].dropna().astype("int64")
        chosen = pd.MultiIndex.from_frame(pairs)
        keep |= pd.MultiIndex.from_frame(truth[keys].astype("int64")).isin(chosen)
    return truth[keep.to_numpy()]


def _lowrank_curves(lowrank: pd.DataFrame | None) -> dict | None:
    if lowrank is None:
        return None
    out = {}
    for layer, df in lowrank.groupby("layer"):
        mean = df.groupby("n_eigs")["corr_active"].mean()
        out[str(int(layer))] = {"n_eigs": [int(v) for v in mean.index], "mean": _floats(mean.to_numpy()),
                                "nan_features": int(df.loc[df["corr_active"].isna(), "out_feature"].nunique()),
                                "features": int(df["out_feature"].nunique())}
    return out


def meta_bundle(run: RunPaths, tables: RunTables, layers: list[int], sites: list[str], counts: dict) -> dict:
    metrics = tables.get("sae_metrics")
    hosvd = tables.get("hosvd")
    meta = {
        "run": run.root.resolve().name,
        "layers": layers,
        "input_sites": sites,
        "output_site": OUTPUT_SITE,
        "default_input_site": DEFAULT_INPUT_SITE,  # the input features' site when no circuit tables exist
        "present": sorted(tables.frames),
        "missing": dict(sorted(tables.missing.items())),
        "counts": [{"layer": k[0], "site": k[1], "n": v} for k, v in sorted(counts.items())],
        "sae_metrics": encode_table(metrics.sort_values(["layer", "site"]) if metrics is not None else None),
        "report": run.report_page.is_file(),
        # attribution graphs: their JSON, and circuit-tracer's viewer where `explore --serve` or
        # `graph --serve` serves it (a path relative to the explorer's root there)
        "graphs": [{"slug": g["slug"], "prompt": str(g.get("prompt", "")), "viewer": viewer_path(g["slug"])}
                   for g in read_index(run.graph_index)],
        "digits": DIGITS,
        # the gate tags the verdicts carry (`pipelines.data.tags`): a column of gate_verdicts each
        "gate_tags": [{"column": tag.column, "name": tag.name, "doc": tag.doc}
                      for tag in present_tags(tables.get("gate_verdicts"), GATE_TAGS)],
        "lowrank": {}, "hosvd": {},
    }
    for site in sites:
        meta["lowrank"][site] = _lowrank_curves(select(tables.get("lowrank"), site))
        if hosvd is not None:
            mine = select(hosvd, site, None).sort_values(["layer", "component"])
            meta["hosvd"][site] = {str(int(k)): _floats(g["singular_value"].to_numpy())
                                   for k, g in mine.groupby("layer")}
    return meta


def bundles(run: RunPaths) -> dict[str, object]:
    """Every data file of the explorer, by name (see the module docstring)."""
    tables = load_tables(run)
    layers = run_layers(tables)
    sites = input_sites(tables)
    counts = feature_counts(tables, sites)
    out = {"meta": meta_bundle(run, tables, layers, sites, counts),
           "index": index_bundle(tables, layers, sites, counts)}
    for layer in layers:
        out[f"features_L{layer}"] = features_bundle(tables, layer)
        for site in sites:
            for file in FILES:
                out[f"{file}_L{layer}_{site}"] = data_bundle(tables, layer, site, file)
    return out
