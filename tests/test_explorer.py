"""The interactive explorer: its data round-trips every table it reads (the registry's columns,
in the registry's order), the index's summary numbers come from gate_verdicts, missing
tables leave marked sections, table text is escaped, and (with Chromium and Playwright) the
site works in a real browser opened from the file system: on a synthetic run with planted
text everywhere, and (slow) on the small demo."""

from __future__ import annotations

import decimal
import http.server
import json
import math
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from circuits.gates.types import GATE_TYPES, layer_shares
from pipelines import schemas
from pipelines.data.story_corpus import NEGATION_GATE
from pipelines.engine.paths import RunPaths
from pipelines.engine.tables import read_table, write_table
from pipelines.explorer import data as xdata
from pipelines.explorer.site import make_server, plotly_bundle, serve, write_explorer
from pipelines.schemas import TABLES

PLANTED = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> & \'quoted\''
PLANTED_CONTEXT = 'she said <b>no</b> and [<script>] \u2028 left'
REL = 10 ** -(xdata.DIGITS - 1) / 2  # 4 significant digits: relative error at most 5e-4

# what the data files are, and the columns each leaves out of its tables (the rest of the
# registry's columns are exported, in the registry's order)
FILES = {
    "circuits": ("interactions", "gates", "gate_truth", "eigen", "eigen_inputs", "lowrank", "group_gates",
                 "group_truth", "gate_ablation", "group_ablation"),
    "verdicts": ("gate_verdicts",),
    "samples": ("lowrank_samples",),
}
PER_LAYER = ("layer", "outputs", "input_site")
LEFT_OUT = {"gate_verdicts": PER_LAYER + ("out_description", "a_description", "b_description"),
            "gates": PER_LAYER + ("cross", "self_a", "self_b", "mean_contribution", "n_both", "n_a_only", "n_b_only"),
            "features": ("layer",), "feature_labels": ("layer", "lift")}
N_TRUTH, N_ABLATE = 4, 2  # candidates per layer with a truth table (gate_truth), ablated per kind
CELLS = ("on_on", "on_off", "off_on", "off_off")
ABLATION_NUMBERS = ("activation_before", "activation_after", "pre_before", "pre_after", "pre_constant",
                    "pre_change_predicted", "activation_local", "logprob_before", "logprob_after")
VERDICT_INTERVENTIONS = ("keep_a", "keep_b", "keep_ab", "synergy", "causal_score", "causal_bound", "sure_and",
                         "gate_type", "cross_share", "own_a_share", "own_b_share", "rest_share", "square_fit")
SHARES = ("share_a", "share_b", "share_other", "share_bias", "share_error")


def exported_columns(name: str, present=()) -> list[str]:
    """The columns the explorer exports of table `name`, whose run has the optional columns among `present`."""
    drop = LEFT_OUT.get(name, PER_LAYER)
    return [c for c in TABLES[name].schema_with(present).names if c not in drop]


# ------------------------------------------------------------------ a synthetic run


def _ranks(frame: pd.DataFrame, by: list[str], ascending: list[bool]) -> pd.Series:
    """1-based ranks of the rows of `frame` in the order `by` (Int64, on frame's index)."""
    order = frame.sort_values(by, ascending=ascending, kind="stable").index
    return pd.Series(np.arange(1, len(order) + 1), index=order).reindex(frame.index).astype("Int64")


def _ablations(rng, chosen: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Three ablations (a, b, both) of each chosen candidate, as the verdicts stage writes them."""
    rows = []
    for r in chosen.to_dict("records"):
        before = float(rng.uniform(1, 3))
        shares = dict(zip(SHARES, rng.dirichlet(np.ones(len(SHARES))).tolist()))
        n = int(rng.integers(10, 60))
        for ablated, keep in (("a", rng.uniform(0.0, 0.9)), ("b", rng.uniform(0.0, 0.9)), ("both", 0.0)):
            rows.append({"out_feature": r["out_feature"], **{k: r[k] for k in keys}, "ablated": ablated, "n_tokens": n,
                         "activation_before": before, "activation_after": before * float(keep),
                         "pre_before": before, "pre_after": before * float(keep) - 0.1, "pre_constant": -0.1,
                         "pre_change_predicted": -before * (1 - float(keep)),
                         "activation_local": before * float(keep), "logprob_before": -5.0,
                         "logprob_after": -5.0 - float(rng.random()), **shares})
    return pd.DataFrame(rows, columns=["out_feature", *keys, "ablated", "n_tokens", *ABLATION_NUMBERS, *SHARES])


def _interventions(rng, members_a=None, members_b=None) -> dict:
    """The intervention columns of a candidate (`circuits.gates.interventions`), random but
    consistent: the keeps are the four points' ratios, the synergy their cross term."""
    act = dict(zip(("act_none", "act_a", "act_b", "act_ab"), [float(rng.uniform(1, 3)), *rng.uniform(0, 1.5, 3)]))
    keep = {f"keep_{k}": act[f"act_{k}"] / act["act_none"] for k in ("a", "b", "ab")}
    synergy = 1 - keep["keep_a"] - keep["keep_b"] + keep["keep_ab"]
    out = {"iv_tokens": int(rng.integers(5, 60)), **act, **{k.replace("act", "pre"): v - 0.2 for k, v in act.items()},
           **keep, "synergy": synergy, **{f"{k}_se": float(rng.uniform(0, 0.1)) for k in ("keep_a", "keep_b", "synergy")},
           "causal_score": float(np.clip(1 - max(keep["keep_a"], keep["keep_b"]), 0, 1) * np.clip(synergy, 0, 1)),
           "gate_type": str(rng.choice(GATE_TYPES[:-1]))}
    # the pre-activation's parts: random, adding up to pre_none less its constant
    out["pre_constant"] = -0.5
    total = out["pre_none"] - out["pre_constant"]
    parts = dict(zip(("own_a", "own_b", "cross", "rest"), total * rng.dirichlet(np.ones(4))))
    out.update({f"form_{k}": v for k, v in parts.items()}, form_self_a=parts["own_a"] / 2, form_self_b=parts["own_b"] / 2,
               **{f"{k}_share": v / total for k, v in parts.items()},
               square_share=(parts["own_a"] / 2 + parts["own_b"] / 2 + parts["cross"]) / total,
               square_fit=parts["cross"] / np.sqrt(parts["own_a"] * parts["own_b"]), square_part=float(rng.uniform(0, 0.5)),
               **layer_shares(*(out[f"pre_{k}"] for k in ("none", "a", "b", "ab")), out["pre_constant"]))
    out["causal_bound"] = out["causal_score"] * float(rng.uniform(0, 1))
    out["sure_and"] = out["gate_type"] == "and" and out["causal_bound"] > 0.2
    if members_a is not None:
        out.update(necessary_a=list(members_a[:1]), necessary_b=list(members_b[:1]))
    return out


def _verdict_columns(row: dict, ablation: pd.DataFrame, keys: list[str], text: str) -> dict:
    """The judged columns of a gate_verdicts row: truth, ablation drops and shares, verdict."""
    mine = ablation
    for k in ["out_feature", *keys]:
        mine = mine[mine[k] == row[k]]
    both, apart = int(row["n_both"]), int(min(row["n_a_only"], row["n_b_only"]))
    truth_and = bool(row["and_data"] >= 0.5)
    truth = (f"needs both inputs (and_data {row['and_data']:.2f}){text}" if truth_and
             else f"fires without both inputs (and_data {row['and_data']:.2f}): OR-like{text}")
    out = {"both_tokens": both, "apart_tokens": apart, "truth": truth, "truth_and": truth_and}
    if len(mine):
        drop = {a: float((g["activation_before"] - g["activation_after"]).iloc[0] / g["activation_before"].iloc[0])
                for a, g in mine.groupby("ablated")}
        kept = {a: float(((g["pre_after"] - g["pre_constant"]) / (g["pre_before"] - g["pre_constant"])).iloc[0])
                for a, g in mine.groupby("ablated")}
        lowered = {a: float((g["logprob_before"] - g["logprob_after"]).iloc[0]) for a, g in mine.groupby("ablated")}
        out.update(drop_a=drop["a"], drop_b=drop["b"], drop_both=drop["both"],
                   **{f"mlp_keep_{a}": v for a, v in kept.items()}, **{f"logprob_drop_{a}": v for a, v in lowered.items()},
                   sae_confirms=min(drop["a"], drop["b"]) >= 0.5, mlp_confirms=max(kept["a"], kept["b"]) <= 0.5,
                   logprob_confirms=min(lowered["a"], lowered["b"]) >= 0.5 * lowered["both"] > 0,
                   ablation_tokens=int(mine["n_tokens"].iloc[0]), **{s: float(mine[s].iloc[0]) for s in SHARES})
        out.update(mlp_disagrees=out["mlp_confirms"] != out["sae_confirms"],
                   logprob_disagrees=out["logprob_confirms"] != out["sae_confirms"])
        is_and = truth_and and min(drop["a"], drop["b"]) >= 0.5
        verdict = "behaves as an AND gate" if is_and else (truth if not truth_and else
                                                            "truth table says AND, but removing one side keeps most")
    else:
        out.update(drop_a=np.nan, drop_b=np.nan, drop_both=np.nan, ablation_tokens=None, **{s: np.nan for s in SHARES},
                   **{f"{m}_{a}": np.nan for m in ("mlp_keep", "logprob_drop") for a in ("a", "b", "both")},
                   **{c: None for c in ("sae_confirms", "mlp_confirms", "logprob_confirms", "mlp_disagrees",
                                        "logprob_disagrees")})
        is_and = False
        verdict = "truth table says AND; no ablation measured" if truth_and else truth
    return {**out, "verdict": verdict + text, "is_and": is_and}


def circuit_tables(rng, n_out: int, n_in: int, text: str = "") -> dict[str, pd.DataFrame]:
    """The circuit and verdict tables of one layer and input site (their own columns; the
    circuit keys are added on writing), consistent with each other as the stages write them."""
    tables = {}
    rows = []
    for f in range(n_out):
        for kind, n in (("self", 4), ("cross", 4), ("linear", 3), ("constant", 1)):
            for rank in range(1, n + 1):
                a = int(rng.integers(0, n_in))
                b = {"self": a, "cross": int(rng.integers(0, n_in)), "linear": -1, "constant": -1}[kind]
                rows.append({"out_feature": f, "rank": rank, "in_a": -1 if kind == "constant" else a, "in_b": b,
                             "kind": kind, "coefficient": float(rng.normal(0, 0.1)) / rank})
    tables["interactions"] = pd.DataFrame(rows)

    # gates: three candidate pairs per output; outputs f % 5 == 4 have none seen together and apart
    combos = [(a, b) for a in range(n_in) for b in range(a + 1, n_in)]
    rows = []
    for f in range(n_out):
        for w, pick in enumerate(rng.choice(len(combos), 3, replace=False), start=1):
            a, b = combos[pick]
            share = float(rng.random())
            and_data = float(rng.uniform(-0.2, 1.0)) if f % 5 != 4 and w < 3 else float("nan")
            rows.append({"out_feature": f, "in_a": a, "in_b": b, "and_score": float(rng.normal()),
                         "cross": float(rng.normal()), "self_a": float(rng.normal()), "self_b": float(rng.normal()),
                         "weight_rank": w, "input_cosine": float(rng.uniform(-1, 1)), "n_active": 300.0 + f,
                         "coactivation": float(rng.random()), "coactivation_lift": float(rng.uniform(0, 4)),
                         "mean_contribution": float(rng.normal()), "contribution_share": share, "and_data": and_data,
                         "n_both": float(rng.integers(0, 100)), "n_a_only": float(rng.integers(0, 100)),
                         "n_b_only": float(rng.integers(0, 100)), "gate_score": share * and_data})
    gates = pd.DataFrame(rows)
    scored = gates[gates["gate_score"].notna()]
    gates["data_rank"] = pd.Series(scored.groupby("out_feature")["gate_score"].rank(ascending=False, method="first"),
                                   dtype="Int64").reindex(gates.index)
    best = gates[gates["data_rank"] == 1]
    gates["layer_rank"] = _ranks(best, ["gate_score"], [False]).reindex(gates.index)
    tables["gates"] = gates
    checked = gates[gates["layer_rank"] <= N_TRUTH]
    tables["gate_truth"] = pd.concat([checked[["out_feature", "in_a", "in_b", "layer_rank"]].assign(
        cell=c, n_tokens=100 + i, mean_activation=float(rng.random()) / (i + 1), active_share=0.5,
        quantile_activation=2.0 - i / 4) for i, c in enumerate(CELLS)])

    tables["eigen"] = pd.DataFrame([{"out_feature": f, "rank": r, "eigenvalue": float(rng.normal()),
                                     "energy_share": float(rng.random()), "activation_share": float(rng.normal())}
                                    for f in range(n_out) for r in range(1, 7)])
    tables["eigen_inputs"] = pd.DataFrame([{"out_feature": f, "eigen_rank": e, "input_rank": i,
                                            "in_feature": int(rng.integers(0, n_in)), "cosine": float(rng.normal())}
                                           for f in range(n_out) for e in range(1, 3) for i in range(1, 4)])
    tables["lowrank"] = pd.DataFrame([{"out_feature": f, "n_eigs": r, "n_active": 40 + f,
                                       "corr_active": float("nan") if f == 0 else float(rng.random())}
                                      for f in range(n_out) for r in range(1, 5)])
    tables["lowrank_samples"] = pd.DataFrame([{"out_feature": f, "sample": t, "n_eigs": r,
                                               "activation": float(rng.random()), "approx": float(rng.normal()),
                                               "offset": 0.5} for f in range(n_out) for t in range(1, 4)
                                              for r in range(1, 5)])

    # the circuit candidate pair of each output: its best scored pair; split ones rank last
    pairs = gates[gates["data_rank"] == 1].copy()
    pairs["split_pair"] = pairs["out_feature"] % 4 == 2
    pairs["circuit_rank"] = _ranks(pairs, ["split_pair", "gate_score", "out_feature"], [True, False, True])
    pair_ablation = _ablations(rng, pairs[pairs["circuit_rank"] <= N_ABLATE], ["in_a", "in_b"])
    tables["gate_ablation"] = pair_ablation

    # group gates: an eigen split and a pair of label classes per output (none for f % 3 == 1),
    # ids unique within the layer; the best scored one of each output ranked in the layer
    rows, gid = [], 0
    for f in range(n_out):
        if f % 3 == 1:
            continue
        for source in ("eigen", "labels"):
            members = [int(m) for m in rng.choice(n_in, int(rng.integers(4, 8)), replace=False)]
            cut = int(rng.integers(1, len(members) - 1))
            share = float(rng.random())
            and_data = float("nan") if source == "labels" and f % 2 else float(rng.uniform(-0.2, 1.0))
            split_share = float(rng.random()) if source == "eigen" else float("nan")
            rows.append({"out_feature": f, "group_a": gid, "group_b": gid + 1, "source": source,
                         "eigen_rank": 1 + f % 2 if source == "eigen" else None,
                         "label_a": ("context=negative" + text) if source == "labels" else None,
                         "label_b": ("context=positive" + text) if source == "labels" else
                         (("negation" + text) if f % 2 == 0 else None),
                         "members_a": members[:cut], "members_b": members[cut:], "n_active": 200 + f,
                         "coactivation": float(rng.random()), "contribution_share": share, "and_data": and_data,
                         "n_both": int(rng.integers(0, 90)), "n_a_only": int(rng.integers(0, 90)),
                         "n_b_only": int(rng.integers(0, 90)), "gate_score": share * and_data,
                         "split_share": split_share, "split_pair": bool(split_share >= 0.5),
                         **_interventions(rng, members[:cut], members[cut:])})
            gid += 2
    groups = pd.DataFrame(rows)
    groups["eigen_rank"] = groups["eigen_rank"].astype("Int64")
    scored = groups[groups["gate_score"].notna()].sort_values(["split_pair", "gate_score"], ascending=[True, False])
    best = scored.drop_duplicates("out_feature")
    groups["circuit_rank"] = _ranks(best, ["split_pair", "gate_score", "out_feature"],
                                    [True, False, True]).reindex(groups.index)
    tables["group_gates"] = groups
    tables["group_truth"] = pd.concat([groups[["out_feature", "group_a", "group_b"]].assign(
        cell=c, n_tokens=50 + i, mean_activation=float(rng.random()) / (i + 1), active_share=0.25)
        for i, c in enumerate(CELLS)])
    ranked = groups[groups["circuit_rank"].notna()]
    group_ablation = _ablations(rng, ranked[ranked["circuit_rank"] <= N_ABLATE], ["group_a", "group_b"])
    tables["group_ablation"] = group_ablation

    # gate_verdicts: one row per output and kind
    label = {i: ("negation" + text) if i % 3 == 0 else None for i in range(n_in)}
    rows = []
    for r in pairs.to_dict("records"):
        a, b = int(r["in_a"]), int(r["in_b"])
        rows.append({"out_feature": r["out_feature"], "kind": "pair", "circuit_rank": r["circuit_rank"], "in_a": a,
                     "in_b": b, "group_a": None, "group_b": None, "members_a": [a], "members_b": [b],
                     "label_a": label[a], "label_b": label[b],
                     **{k: r[k] for k in ("gate_score", "contribution_share", "coactivation", "and_data",
                                          "input_cosine", "coactivation_lift", "split_pair")},
                     "same_top_token": bool(a % 2 == b % 2),
                     **{k: v for k, v in _interventions(rng).items() if k in VERDICT_INTERVENTIONS},
                     "necessary_a": None, "necessary_b": None,
                     **_verdict_columns(r, pair_ablation, ["in_a", "in_b"], text),
                     "negation_gate": None if r["out_feature"] % 3 == 0 else bool(r["out_feature"] % 3 == 1),
                     "out_description": f"out {r['out_feature']}{text}", "a_description": f"#{a}{text}",
                     "b_description": f"#{b}{text}"})
    for r in ranked.to_dict("records"):
        rows.append({"out_feature": r["out_feature"], "kind": "group", "circuit_rank": r["circuit_rank"], "in_a": None,
                     "in_b": None, "group_a": r["group_a"], "group_b": r["group_b"], "members_a": r["members_a"],
                     "members_b": r["members_b"], "label_a": r["label_a"], "label_b": r["label_b"],
                     **{k: r[k] for k in ("gate_score", "contribution_share", "coactivation", "and_data", "split_pair")},
                     "same_top_token": None, "input_cosine": np.nan, "coactivation_lift": np.nan,
                     **{k: r[k] for k in (*VERDICT_INTERVENTIONS, "necessary_a", "necessary_b")},
                     **_verdict_columns(r, group_ablation, ["group_a", "group_b"], text),
                     "negation_gate": bool(r["out_feature"] % 2 == 0),
                     "out_description": f"out {r['out_feature']}{text}", "a_description": f"group a{text}",
                     "b_description": f"group b{text}"})
    verdicts = pd.DataFrame(rows)
    for c in ("circuit_rank", "in_a", "in_b", "group_a", "group_b", "ablation_tokens"):
        verdicts[c] = verdicts[c].astype("Int64")
    tables["gate_verdicts"] = verdicts
    return tables


def synthetic_run(root: Path, layers=(0, 1), n_out: int = 12, n_in: int = 16, sites=("resid_mid",),
                  skip=(), seed: int = 0, text: str = "") -> RunPaths:
    """Every table the explorer reads, written with the registry's schemas as the stages write
    them, with random numbers (and `text` planted in every text column the pages show); also
    rows of another output set (HOSVD components) that the explorer must leave out."""
    run = RunPaths(root)
    rng = np.random.default_rng(seed)
    for layer in layers:
        for site in sites:
            keys = {"outputs": "sae", "input_site": site}
            for name, df in circuit_tables(rng, n_out, n_in, text).items():
                if name not in skip:
                    schemas.write(df.assign(**keys), run.tables, name, layer, part=f"{site}-sae")
            # `--outputs hosvd`: its components are out_features of the circuit tables too
            hosvd = {"outputs": "hosvd", "input_site": site}
            other = circuit_tables(rng, n_out + 5, n_in + 3)
            for name in ("interactions", "eigen", "lowrank"):
                if name not in skip:
                    schemas.write(other[name].assign(**hosvd), run.tables, name, layer, part=f"{site}-hosvd")
            if "hosvd" not in skip:
                values = np.sort(rng.random(6))[::-1] * 10
                schemas.write(pd.DataFrame({"component": range(6), "singular_value": values, **hosvd}),
                              run.tables, "hosvd", layer, part=f"{site}-hosvd")
        feats, labels = [], []
        for site, n in (("mlp_out", n_out), *((s, n_in) for s in sites)):
            for f in range(n):
                feats.append({"site": site, "feature": f, "frequency": float(rng.random()) / 10,
                              "max_activation": float(rng.random() * 5), "mean_activation": float(rng.random()),
                              "top_contexts": [f"the cat [sat{f}] on", f"a dog [ran] far {site}{text}"],
                              "top_documents": [1, 2], "top_tokens": [f"sat{f}", "ran" + text],
                              "sample_contexts": [f"x [y] z{f}{text}"], "sample_quantiles": [0.5],
                              "top_token": f"sat{f}", "top_token_share": 0.4, "is_token_feature": f % 4 == 0,
                              "boosted_tokens": ["good", "happy" + text] if site == "mlp_out" else [],
                              "suppressed_tokens": ["bad" + text] if site == "mlp_out" else [],
                              "label": ("negative" + text) if f % 2 else None, "label_share": 0.6 if f % 2 else None,
                              "boost_label": ("positive" + text) if site == "mlp_out" and f % 3 == 0 else None,
                              "boost_sd": 2.5 if site == "mlp_out" and f % 3 == 0 else None,
                              "description": f"{site} feature {f} on sat{f}"})
                for cls in ("negative", "positive" + text):
                    labels.append({"site": site, "feature": f, "channel": "context" + text, "class": cls,
                                   "kind": "activation_share", "value": float(rng.random()),
                                   "lift": float(rng.uniform(0, 3)), "n_tokens": None})
                if site == "mlp_out":
                    labels.append({"site": site, "feature": f, "channel": "lexicon", "class": "positive" + text,
                                   "kind": "logit_boost", "value": float(rng.normal()), "lift": None,
                                   "n_tokens": int(rng.integers(1, 20))})
        features, labels = pd.DataFrame(feats), pd.DataFrame(labels)
        for site in ("mlp_out", *sites):  # one part per site, as the features stage writes them
            if "features" not in skip:
                schemas.write(features[features["site"] == site], run.tables, "features", layer, part=site)
            if "feature_labels" not in skip:
                schemas.write(labels[labels["site"] == site], run.tables, "feature_labels", layer, part=site)
        if "sae_metrics" not in skip:
            metrics = pd.DataFrame([{"site": s, "hook": f"blocks.{layer}.hook_{s}", "d_in": 8,
                                     "d_sae": n_out if s == "mlp_out" else n_in, "k": 2, "train_tokens": 1000,
                                     "eval_tokens": 100, "nmse": float(rng.random()), "l0": 2.0,
                                     "dead_fraction": float(rng.random()), "loss_clean": 3.0, "loss_patched": 3.1,
                                     "loss_added": 0.1 / 3} for s in ("mlp_out", *sites)])
            schemas.write(metrics, run.tables, "sae_metrics", layer)
    return run


def plant(run: RunPaths, layer: int, site: str, feature: int, description: str = PLANTED, context: str | None = None) -> None:
    """Replace one feature's description (and first top context) in the features table."""
    features = read_table(run.tables, "features", [layer])
    hit = (features["site"] == site) & (features["feature"] == feature)
    assert hit.sum() == 1
    features.loc[hit, "description"] = description
    if context is not None:
        index = features.index[hit][0]
        features.at[index, "top_contexts"] = [context] + list(features.at[index, "top_contexts"])[1:]
    schemas.write(features[features["site"] == site], run.tables, "features", layer, part=site)


def plant_verdict(run: RunPaths, layer: int, site: str, out: int, verdict: str) -> None:
    """Replace the verdict text of output `out`'s pair candidate in gate_verdicts (its best
    ranked row: split pairs that outscore it come after it)."""
    verdicts = schemas.select(read_table(run.tables, "gate_verdicts", [layer]), site)
    mine = (verdicts["out_feature"] == out) & (verdicts["kind"] == "pair")
    hit = mine & (verdicts["circuit_rank"] == verdicts.loc[mine, "circuit_rank"].min())
    assert hit.sum() == 1
    verdicts.loc[hit, "verdict"] = verdict
    schemas.write(verdicts, run.tables, "gate_verdicts", layer, part=f"{site}-sae")


def load_data(run: RunPaths, name: str):
    return xdata.parse_script((run.explorer / "data" / f"{name}.js").read_text(encoding="utf-8"))


def source_table(run: RunPaths, name: str, layer: int, site: str | None = None) -> pd.DataFrame:
    """Table `name`'s rows of one layer (and input site, output SAE) in the registry's order."""
    df = read_table(run.tables, name, [layer])
    if site is not None:
        df = schemas.select(df, site)
    return df.sort_values(list(TABLES[name].sort), kind="stable").reset_index(drop=True)


def _expected(value):
    """A table's value as the JSON data holds it (floats left unrounded)."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_expected(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return str(value)


def assert_same(got, want, where) -> None:
    """One exported value equals the table's: exactly, floats within the rounding, a null
    list as []."""
    want = _expected(want)
    if isinstance(want, list) or (want is None and isinstance(got, list)):
        want = want or []
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for g, w in zip(got, want):
            assert_same(g, w, where)
    elif isinstance(want, float):
        assert isinstance(got, (int, float)) and not isinstance(got, bool), (where, got, want)
        assert abs(got - want) <= REL * abs(want) + 1e-300, (where, got, want)
    else:
        assert got == want and type(got) is type(want), (where, got, want)


def assert_close_frames(exported: pd.DataFrame, source: pd.DataFrame, columns: list[str]) -> None:
    """Exported columns equal the source's, row by row (see `assert_same`)."""
    assert len(exported) == len(source)
    for c in columns:
        for i, (g, w) in enumerate(zip(exported[c], source[c])):
            assert_same(g, w, (c, i))


def eq(series: pd.Series, value) -> pd.Series:
    """`series == value` with nulls False (for nullable integer columns)."""
    return series.eq(value).fillna(False).astype(bool)


def data_names(layers, sites) -> list[str]:
    return sorted(["meta.js", "index.js", *(f"features_L{layer}.js" for layer in layers),
                   *(f"{file}_L{layer}_{site}.js" for layer in layers for site in sites for file in FILES)])


# ------------------------------------------------------------------ unit tests


def test_round_sig_keeps_four_significant_digits():
    values = np.array([0.123456, -98765.4321, 1.0, 0.0, 9.99996, 1.23456e-7, -3.3333e12, float("nan"), float("inf"), 5e-320])
    rounded = xdata.round_sig(values)
    for v, r in zip(values, rounded):
        if not math.isfinite(v):
            assert (math.isnan(v) and math.isnan(r)) or r == v
        elif v == 0:
            assert r == 0
        else:
            assert abs(r - v) <= REL * abs(v), (v, r)
            assert float(f"{v:.4g}") == pytest.approx(r, rel=1e-12)
    assert xdata._floats([0.1234449, 2.0, float("nan"), -0.0]) == [0.1234, 2, None, 0]
    assert len(json.dumps(xdata._floats(np.random.default_rng(0).normal(size=1000)))) < 1000 * 10


def test_the_explorer_reads_the_registry():
    # every table the explorer shows is in the registry; the data files hold each once
    assert {k: tuple(v) for k, v in xdata.FILES.items()} == FILES
    assert set(xdata.LAYER_TABLES) | set(xdata.OTHER_TABLES) <= set(TABLES)
    for name in xdata.LAYER_TABLES:
        assert TABLES[name].circuit and TABLES[name].stage in ("circuits", "verdicts"), name


def test_export_matches_tables(tmp_path):
    run = synthetic_run(tmp_path / "run")
    write_explorer(run)
    for layer in (0, 1):
        for file, names in FILES.items():
            bundle = load_data(run, f"{file}_L{layer}_resid_mid")
            assert sorted(bundle) == sorted(names)
            for name in names:
                source = source_table(run, name, layer, "resid_mid")
                if name == "lowrank_samples":  # ranks 1, 2 and the largest (4) only, as the report's scatter
                    source = source[source["n_eigs"] != 3].reset_index(drop=True)
                columns = exported_columns(name, source.columns)
                exported = xdata.decode_table(bundle[name])
                assert list(exported.columns) == columns, name
                assert len(exported) > 0, name
                assert_close_frames(exported, source, columns)
                # coded columns are codes in the file, and only those the registry names
                assert sorted(bundle[name]["categories"]) == sorted(c for c in TABLES[name].categories if c in columns)
        feats = load_data(run, f"features_L{layer}")
        for name in ("features", "feature_labels"):
            source = source_table(run, name, layer)
            exported = xdata.decode_table(feats[name])
            assert list(exported.columns) == exported_columns(name)
            assert_close_frames(exported, source, exported_columns(name))
        # the HOSVD components' circuit rows are another output set: left out
        interactions = read_table(run.tables, "interactions", [layer])
        assert load_data(run, f"circuits_L{layer}_resid_mid")["interactions"]["n"] == \
            int((interactions["outputs"] == "sae").sum()) < len(interactions)
    # the index: one row per output feature, with the rank-2 correlation, the circuit
    # candidate pair and best group gate from gate_verdicts, and the top energy share
    index = load_data(run, "index")
    base = xdata.decode_table(index["features"])
    stats = xdata.decode_table(index["stats"]["resid_mid"])
    assert len(base) == len(stats) == 2 * 12 and index["corr_rank"] == 2
    assert list(base[["layer", "feature"]].itertuples(index=False, name=None)) == [(l, f) for l in (0, 1) for f in range(12)]
    lowrank, eigen, features = (schemas.select(read_table(run.tables, n)) for n in ("lowrank", "eigen", "features"))
    verdicts = schemas.select(read_table(run.tables, "gate_verdicts"))
    assert set(stats.columns) == {"corr", "n_active", "eig1", "energy1", *(f"{p}_{c}" for p in ("gate", "group") for c in (
        "rank", "type", "causal", "share", "and_data", "coactivation", "split", "a", "b"))}
    seen = {"pair": 0, "group": 0}
    for i, row in base.iterrows():
        layer, f = row["layer"], row["feature"]
        mine = lowrank[(lowrank["layer"] == layer) & (lowrank["out_feature"] == f) & (lowrank["n_eigs"] == 2)].iloc[0]
        assert_same(stats.at[i, "corr"], mine["corr_active"], ("corr", i))
        assert_same(stats.at[i, "n_active"], mine["n_active"], ("n_active", i))
        for kind, prefix in (("pair", "gate"), ("group", "group")):
            v = verdicts[(verdicts["layer"] == layer) & (verdicts["out_feature"] == f) & (verdicts["kind"] == kind)]
            assert len(v) <= 1
            if len(v):
                seen[kind] += 1
                v = v.iloc[0]
                for column, key in (("circuit_rank", "rank"), ("gate_type", "type"), ("causal_score", "causal"),
                                    ("contribution_share", "share"), ("and_data", "and_data"),
                                    ("coactivation", "coactivation"), ("split_pair", "split"), ("members_a", "a"),
                                    ("members_b", "b")):
                    assert_same(stats.at[i, f"{prefix}_{key}"], v[column], (prefix, key, i))
            else:
                assert stats.at[i, f"{prefix}_rank"] is None and stats.at[i, f"{prefix}_share"] is None
                assert stats.at[i, f"{prefix}_split"] is None and stats.at[i, f"{prefix}_a"] == []
        top = eigen[(eigen["layer"] == layer) & (eigen["out_feature"] == f) & (eigen["rank"] == 1)].iloc[0]
        assert_same(stats.at[i, "eig1"], top["eigenvalue"], ("eig1", i))
        assert_same(stats.at[i, "energy1"], top["energy_share"], ("energy1", i))
        assert row["description"] == f"mlp_out feature {f} on sat{f}"
        out = features[(features["layer"] == layer) & (features["site"] == "mlp_out") & (features["feature"] == f)].iloc[0]
        assert_same(row["frequency"], out["frequency"], ("frequency", i))
        assert row["top_tokens_text"] == f"sat{f} ran"
    # some outputs have no candidate of a kind: their columns are null
    assert 0 < seen["pair"] < len(base) and 0 < seen["group"] < len(base)
    meta = load_data(run, "meta")
    assert meta["layers"] == [0, 1] and meta["input_sites"] == ["resid_mid"] and meta["missing"] == {}
    assert meta["present"] == sorted([*FILES["circuits"], *FILES["verdicts"], *FILES["samples"], "features",
                                      "feature_labels", "sae_metrics", "hosvd"])
    assert "verdicts" not in meta  # the verdicts are a data file of their own
    # the synthetic verdicts carry the stories' gate tag: its column is exported (above) and named for the pages
    assert meta["gate_tags"] == [{"column": "negation_gate", "name": "negation gate", "doc": NEGATION_GATE.doc}]
    assert {(c["layer"], c["site"]): c["n"] for c in meta["counts"]} == {
        (l, s): n for l in (0, 1) for s, n in (("mlp_out", 12), ("resid_mid", 16))}
    metrics = read_table(run.tables, "sae_metrics").sort_values(["layer", "site"]).reset_index(drop=True)
    exported = xdata.decode_table(meta["sae_metrics"])
    assert list(exported.columns) == TABLES["sae_metrics"].names
    assert_close_frames(exported, metrics, TABLES["sae_metrics"].names)
    hosvd = read_table(run.tables, "hosvd")
    for layer in (0, 1):
        want = hosvd[hosvd["layer"] == layer].sort_values("component")["singular_value"]
        for g, w in zip(meta["hosvd"]["resid_mid"][str(layer)], want, strict=True):
            assert_same(g, w, "hosvd")
        curve = meta["lowrank"]["resid_mid"][str(layer)]
        mine = lowrank[lowrank["layer"] == layer]
        assert curve["n_eigs"] == [1, 2, 3, 4] and curve["features"] == 12 and curve["nan_features"] == 1
        for g, w in zip(curve["mean"], mine.groupby("n_eigs")["corr_active"].mean(), strict=True):
            assert_same(g, w, "lowrank curve")


def test_columns_keep_their_types():
    encode = xdata.encode_column
    assert encode(pd.Series([True, None, False], dtype=object)) == ([True, None, False], None)
    assert encode(pd.Series(["a", None, float("nan"), 3, 2.5], dtype=object)) == (["a", None, None, 3, 2.5], None)
    assert encode(pd.Series(["a", pd.NA], dtype="string")) == (["a", None], None)
    assert encode(pd.Series([1, None], dtype="Int64")) == ([1, None], None)
    assert encode(pd.Series(["x", None, "y", "x"]), categorical=True) == ([0, -1, 1, 0], ["x", "y"])
    assert encode(pd.Series([[0.123456, float("nan")], None, []], dtype=object)) == ([[0.1235, None], [], []], None)
    assert encode(pd.Series([np.array([3, 1]), np.array([], dtype=np.int64)], dtype=object)) == ([[3, 1], []], None)
    table = xdata.encode_table(pd.DataFrame({"kind": ["self", "cross", None], "v": [1.0, float("inf"), 0.5]}),
                               categories=["kind"])
    assert xdata.decode_table(table).to_dict("list") == {"kind": ["self", "cross", None], "v": [1, None, 0.5]}


def test_site_files_work_offline(tmp_path):
    run = synthetic_run(tmp_path / "run")
    index = write_explorer(run)
    assert index == run.explorer / "index.html" and index.is_file()
    bundle = plotly_bundle()
    assert bundle is not None, "plotly is a dependency: its bundle must ship with the site"
    assert (run.explorer / "static" / "plotly.min.js").read_bytes() == bundle.read_bytes()
    html = index.read_text(encoding="utf-8")
    app = (run.explorer / "static" / "app.js").read_text(encoding="utf-8")
    for text in (html, app):
        assert "http://" not in text and "https://" not in text and "fetch(" not in text and "XMLHttpRequest" not in text
    for src in ("data/meta.js", "data/index.js", "static/app.js", "static/style.css"):
        assert src in html and (run.explorer / src).is_file()
    names = sorted(p.name for p in (run.explorer / "data").iterdir())
    assert names == data_names((0, 1), ("resid_mid",))
    for path in (run.explorer / "data").iterdir():
        xdata.parse_script(path.read_text(encoding="utf-8"))  # valid JSON inside
    # the app asks for exactly these files
    assert "need(`features_L${layer}`)" in app and "need(`${file}_L${layer}_${state.site}`)" in app
    for file in FILES:
        assert f'needSite("{file}", layer)' in app, file
    # rewriting replaces the folder (no stale files)
    (run.explorer / "data" / "stale.js").write_text("x", encoding="utf-8")
    write_explorer(run)
    assert not (run.explorer / "data" / "stale.js").exists()


def test_missing_tables_build_with_sections_marked(tmp_path):
    skipped = ("eigen", "gate_truth", "features", "sae_metrics", "gate_verdicts", "group_gates", "hosvd")
    run = synthetic_run(tmp_path / "run", skip=skipped)
    # a table written by an older version, lacking a column, counts as missing too
    for name, column in (("lowrank", "corr_active"), ("gates", "coactivation_lift")):
        old = read_table(run.tables, name).drop(columns=[column])
        shutil.rmtree(run.tables / name)
        for layer, frame in old.groupby("layer"):
            write_table(frame, run.tables, name, int(layer), part="resid_mid-sae")
    write_explorer(run)
    meta = load_data(run, "meta")
    for name in skipped:
        assert meta["missing"][name] == "not in this run", name
    assert "corr_active" in meta["missing"]["lowrank"] and "coactivation_lift" in meta["missing"]["gates"]
    assert set(meta["missing"]) == {*skipped, "lowrank", "gates"}
    assert not set(meta["present"]) & set(meta["missing"])
    circuits = load_data(run, "circuits_L0_resid_mid")
    for name in ("eigen", "gates", "gate_truth", "group_gates", "lowrank"):
        assert circuits[name] is None, name
    assert circuits["interactions"]["n"] > 0 and circuits["group_truth"]["n"] > 0
    assert load_data(run, "verdicts_L0_resid_mid") == {"gate_verdicts": None}
    assert load_data(run, "features_L0")["features"] is None
    assert load_data(run, "features_L0")["feature_labels"]["n"] > 0
    index = load_data(run, "index")
    assert index["features"]["n"] == 2 * 12  # the feature count comes from the circuit tables
    assert not {"gate_rank", "gate_share", "group_rank", "group_share", "energy1", "corr"} & set(
        index["stats"]["resid_mid"]["columns"])
    assert "description" not in index["features"]["columns"]
    assert meta["hosvd"] == {} and meta["lowrank"] == {"resid_mid": None} and meta["sae_metrics"] is None
    assert meta["gate_tags"] == []  # no verdicts, no gate tag
    app = (Path(xdata.__file__).parent / "static" / "app.js").read_text(encoding="utf-8")
    assert "data-missing" in app  # the page marks each section whose table is missing
    for name in ("gate_verdicts", "group_gates", "gate_truth", "group_truth", "gate_ablation", "group_ablation"):
        assert f'"{name}"' in app, name  # and names these tables when they are


def test_a_run_without_tables_still_builds(tmp_path):
    run = RunPaths(tmp_path / "empty")
    run.root.mkdir()
    write_explorer(run)
    meta = load_data(run, "meta")
    assert meta["layers"] == [] and meta["present"] == [] and "interactions" in meta["missing"]
    assert set(meta["missing"]) == set(xdata.LAYER_TABLES) | set(xdata.OTHER_TABLES)
    assert load_data(run, "index")["features"]["n"] == 0
    assert sorted(p.name for p in (run.explorer / "data").iterdir()) == ["index.js", "meta.js"]


def test_several_input_sites(tmp_path):
    sites = ("mlp_in", "resid_mid")
    run = synthetic_run(tmp_path / "run", layers=(0,), sites=sites)
    write_explorer(run)
    meta = load_data(run, "meta")
    assert meta["input_sites"] == ["resid_mid", "mlp_in"]
    assert sorted(p.name for p in (run.explorer / "data").iterdir()) == data_names((0,), sites)
    index = load_data(run, "index")
    assert set(index["stats"]) == set(sites)
    verdicts = read_table(run.tables, "gate_verdicts")
    for site in sites:
        for file, names in FILES.items():
            bundle = load_data(run, f"{file}_L0_{site}")
            for name in names:
                source = source_table(run, name, 0, site)
                if name == "lowrank_samples":
                    source = source[source["n_eigs"] != 3].reset_index(drop=True)
                assert_close_frames(xdata.decode_table(bundle[name]), source, exported_columns(name))
        # each site's index numbers come from its own verdicts
        stats = xdata.decode_table(index["stats"][site])
        mine = schemas.select(verdicts, site)
        pairs = mine[mine["kind"] == "pair"].set_index("out_feature")
        for f in range(12):
            want = pairs["circuit_rank"].get(f)
            assert stats.at[f, "gate_rank"] == (None if want is None else int(want))
            if want is not None:
                assert_same(stats.at[f, "gate_share"], pairs.at[f, "contribution_share"], (site, f))
        assert meta["hosvd"][site]["0"]
    a, b = (xdata.decode_table(index["stats"][s]) for s in sites)
    assert a["gate_share"].tolist() != b["gate_share"].tolist()  # the sites' numbers differ
    assert {(c["layer"], c["site"]) for c in meta["counts"]} == {(0, "mlp_out"), (0, "mlp_in"), (0, "resid_mid")}


def test_group_members_count_as_input_features(tmp_path):
    run = synthetic_run(tmp_path / "run", layers=(0,), n_in=16)
    groups = read_table(run.tables, "group_gates")
    groups.at[0, "members_b"] = [*groups.at[0, "members_b"], 40]  # an input id no other table uses
    schemas.write(groups, run.tables, "group_gates", 0, part="resid_mid-sae")
    shutil.rmtree(run.tables / "sae_metrics")
    shutil.rmtree(run.tables / "features")
    write_explorer(run)
    counts = {(c["layer"], c["site"]): c["n"] for c in load_data(run, "meta")["counts"]}
    assert counts[(0, "resid_mid")] == 41 and counts[(0, "mlp_out")] == 12


def test_table_text_stays_data_and_the_shell_is_escaped(tmp_path):
    root = tmp_path / "run <i>&amp"  # a folder name is text too
    run = synthetic_run(root, layers=(0,), text=PLANTED)
    plant(run, 0, "mlp_out", 3, PLANTED, PLANTED_CONTEXT)
    write_explorer(run)
    html = (run.explorer / "index.html").read_text(encoding="utf-8")
    assert "<i>" not in html and "run &lt;i&gt;&amp;amp" in html
    for path in (run.explorer / "data").iterdir():
        text = path.read_text(encoding="utf-8")
        assert "\u2028" not in text  # a raw line separator would end a JS string in older engines
    features = xdata.decode_table(load_data(run, "features_L0")["features"])
    row = features[(features["site"] == "mlp_out") & (features["feature"] == 3)].iloc[0]
    assert row["description"] == PLANTED and row["top_contexts"][0] == PLANTED_CONTEXT
    assert row["top_tokens"][1] == "ran" + PLANTED and row["boosted_tokens"][1] == "happy" + PLANTED
    assert row["suppressed_tokens"] == ["bad" + PLANTED] and row["sample_contexts"][0].endswith(PLANTED)
    assert row["boost_label"] == "positive" + PLANTED
    assert features.loc[features["feature"] == 1, "label"].tolist() == ["negative" + PLANTED] * 2
    labels = xdata.decode_table(load_data(run, "features_L0")["feature_labels"])
    assert set(labels["channel"]) == {"context" + PLANTED, "lexicon"} and "positive" + PLANTED in set(labels["class"])
    index = xdata.decode_table(load_data(run, "index")["features"])
    assert index.loc[index["feature"] == 3, "description"].iloc[0] == PLANTED
    assert PLANTED in index.loc[index["feature"] == 3, "top_tokens_text"].iloc[0]
    verdicts = xdata.decode_table(load_data(run, "verdicts_L0_resid_mid")["gate_verdicts"])
    assert all(v.endswith(PLANTED) for v in verdicts["verdict"]) and all(v.endswith(PLANTED) for v in verdicts["truth"])
    assert "negation" + PLANTED in set(verdicts["label_a"]) | set(verdicts["label_b"])
    groups = xdata.decode_table(load_data(run, "circuits_L0_resid_mid")["group_gates"])
    assert "context=negative" + PLANTED in set(groups["label_a"])


def test_serve_binds_locally_and_serves_the_site(tmp_path, monkeypatch, capsys):
    run = synthetic_run(tmp_path / "run", layers=(0,))
    write_explorer(run)
    server = make_server(run.explorer, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as response:
            assert response.status == 200 and b'id="main"' in response.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/meta.js", timeout=10) as response:
            assert xdata.parse_script(response.read().decode())["layers"] == [0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/verdicts_L0_resid_mid.js", timeout=10) as response:
            assert xdata.parse_script(response.read().decode())["gate_verdicts"]["n"] > 0
    finally:
        server.shutdown()
        server.server_close()

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(http.server.ThreadingHTTPServer, "serve_forever", interrupted)
    serve(run.explorer, port=0)
    out = capsys.readouterr().out
    assert "http://127.0.0.1:" in out and "Ctrl-C" in out and "stopped" in out
    with pytest.raises(FileNotFoundError):
        make_server(tmp_path / "nowhere", port=0)


# ------------------------------------------------------------------ in a browser

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
BUDGET_MS = 2000
INDEX_KEYS = ["layer", "feature", "description", "frequency", "corr", "gate_rank", "gate_share", "group_rank",
              "group_share", "energy1"]


def chromium_path() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; the browser is Debian's chromium)")
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium at /usr/bin/chromium (apt-get install chromium) or $CHROMIUM")
    profile = tempfile.mkdtemp(prefix="explorer-chromium-")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(profile, executable_path=path, args=CHROMIUM_ARGS, headless=True,
                                                       viewport={"width": 1400, "height": 1000})
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


def test_the_served_explorer_runs_under_the_servers_script_policy(browser, tmp_path):
    """`explore --serve` sends HTML with a Content-Security-Policy that runs only the page's own
    scripts (`pipelines.engine.server.content_policy`): served over HTTP, the index, a layer's
    and a feature's pages render with their Plotly figures and the policy blocks nothing."""
    run = synthetic_run(tmp_path / "run", layers=(0,))
    write_explorer(run)
    server = make_server(run.explorer, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "404" not in m.text else None)
    page.on("response", lambda r: errors.append(r.url) if r.status >= 400 and not r.url.endswith("/favicon.ico") else None)
    try:
        page.add_init_script("""window.__blocked = [];
            document.addEventListener('securitypolicyviolation', e => window.__blocked.push(e.violatedDirective))""")
        response = page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
        assert "script-src 'self'" in response.headers["content-security-policy"]
        drawn = {}
        for route, plot in [("#/", None), ("#/layer/0", "#hist-gate"), ("#/out/0/1", "#heatmap")]:
            page.evaluate(f"location.hash = {json.dumps(route)}")
            page.wait_for_function("document.getElementById('main').dataset.ready === '1'", timeout=30000)
            if plot:
                page.wait_for_selector(f"{plot} .main-svg", timeout=30000)
                drawn[route] = page.locator(f"{plot} .main-svg").count()
        blocked = page.evaluate("window.__blocked")
    finally:
        page.close()
        server.shutdown()
        server.server_close()
    assert blocked == [] and not errors, (blocked, errors)
    assert all(n >= 1 for n in drawn.values()) and len(drawn) == 2


class Page:
    """A page of the explorer, with the console errors and the requests it made."""

    def __init__(self, context, root: Path):
        self.page = context.new_page()
        self.root = root
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None)
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("dialog", lambda d: (self.errors.append(f"dialog: {d.message}"), d.dismiss()))

    def open(self, hash_: str = "") -> dict:
        """Load index.html (a fresh document) at `hash_`; the render timing, counted from the
        document's start (loading the page and its data included)."""
        self.page.goto("about:blank")  # else a change of hash alone would not load the document again
        self.page.goto((self.root / "index.html").as_uri() + hash_)
        timing = self.wait(1)
        start = timing["at"] - timing["ms"]  # when the app began to render
        return {**timing, "ms": timing["at"], "content": timing["content"] + start}

    def go(self, hash_: str) -> dict:
        """Follow a route within the page, as a link does."""
        n = self.page.evaluate("window.BCX_TIMINGS.length")
        self.page.evaluate(f"location.hash = {json.dumps(hash_)}")
        return self.wait(n + 1)

    def wait(self, n: int) -> dict:
        self.page.wait_for_function(f"window.BCX_TIMINGS && window.BCX_TIMINGS.length >= {n} && "
                                    "document.getElementById('main').dataset.ready === '1'", timeout=30000)
        return self.page.evaluate("window.BCX_TIMINGS[window.BCX_TIMINGS.length - 1]")

    def after_click(self, selector: str) -> dict:
        n = self.page.evaluate("window.BCX_TIMINGS.length")
        self.page.click(selector)
        return self.wait(n + 1)

    def text(self, selector: str) -> str:
        return self.page.inner_text(selector)

    def safe(self) -> None:
        """No planted script ran and no planted element exists."""
        assert self.page.evaluate("window.__pwned") is None
        assert self.page.locator("#main script, #main img").count() == 0

    def rows(self, selector: str) -> list[str]:
        return self.page.locator(f"{selector} tbody tr").all_inner_texts()


def js_number(value: float) -> str:
    """A number as the app prints it: `String(Number(v.toPrecision(4)))` in JavaScript."""
    r = float(f"{value:.4g}")
    if r == int(r) and abs(r) < 1e21:
        return str(int(r))
    if 1e-6 <= abs(r) < 1e21:
        return np.format_float_positional(r, trim="-")
    return re.sub(r"e([+-])0*(\d)", lambda m: f"e{m.group(1)}{m.group(2)}", repr(r))


def shown(value) -> str:
    """A table's value as a cell shows it: a number as `js_number`, a null as a dash."""
    return "–" if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)) else js_number(value)


def index_order(stats: pd.DataFrame, key: str, descending: bool) -> list[int]:
    """Rows of the index sorted by `key` as the app sorts them: nulls last, ties in row order."""
    valued = [i for i in range(len(stats)) if stats.at[i, key] is not None]
    valued.sort(key=lambda i: (-stats.at[i, key] if descending else stats.at[i, key], i))
    return valued + [i for i in range(len(stats)) if stats.at[i, key] is None]


@pytest.fixture(scope="module")
def synthetic_site(tmp_path_factory):
    """A synthetic run of two layers and two input sites with PLANTED in every text column,
    a planted description and context on the output of layer 1's best circuit candidate pair
    and on its first input, and a planted verdict text."""
    run = synthetic_run(tmp_path_factory.mktemp("explorer_synthetic") / "run", sites=("resid_mid", "mlp_in"),
                        text=PLANTED)
    layer = 1
    verdicts = schemas.select(read_table(run.tables, "gate_verdicts", [layer]))
    pair = verdicts[(verdicts["kind"] == "pair") & (verdicts["circuit_rank"] == 1)].iloc[0]
    out, a = int(pair["out_feature"]), int(pair["in_a"])
    # a best group gate (ablated) of another output
    group = verdicts[(verdicts["kind"] == "group") & (verdicts["circuit_rank"] <= N_ABLATE)
                     & (verdicts["out_feature"] != out)].sort_values("circuit_rank").iloc[0]
    plant(run, layer, "mlp_out", out, PLANTED, PLANTED_CONTEXT)
    plant(run, layer, "resid_mid", a, PLANTED + " (input)")
    plant_verdict(run, layer, "resid_mid", out, "verdict: " + PLANTED)
    write_explorer(run)
    return SimpleNamespace(paths=run, tables=run.tables, explorer=run.explorer, layer=layer, out=out, a=a,
                           b=int(pair["in_b"]), group_out=int(group["out_feature"]))


def test_explorer_pages_in_a_browser(browser, synthetic_site):
    """Every kind of page on the synthetic run: what the tables hold is on the page, planted
    text stays text, the new tables (group gates, verdicts) are shown and linked."""
    site = synthetic_site
    run, layer, out = site.paths, site.layer, site.out
    page = Page(browser, site.explorer)
    p = page.page
    verdicts = schemas.select(read_table(run.tables, "gate_verdicts"))
    index = load_data(run, "index")
    base, stats = xdata.decode_table(index["features"]), xdata.decode_table(index["stats"]["resid_mid"])

    # the index: the columns of the circuit candidates, their numbers, sorting by pair rank
    page.open()
    assert p.eval_on_selector_all("#index-table th", "t => t.map(x => x.dataset.key)") == INDEX_KEYS
    heads = page.text("#index-table thead")
    for label in ("pair rank", "pair share", "group rank", "group share", "rank-2 corr", "top eigen energy"):
        assert label in heads, label
    cells = p.eval_on_selector_all("#index-body tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
    assert len(cells) == len(base) == 24
    for i, row in enumerate(cells):
        layer_i, f = int(base.at[i, "layer"]), int(base.at[i, "feature"])
        assert row[:2] == [str(layer_i), str(f)]
        for kind, column in (("pair", 5), ("group", 7)):
            v = verdicts[(verdicts["layer"] == layer_i) & (verdicts["out_feature"] == f) & (verdicts["kind"] == kind)]
            assert row[column] == (shown(v["circuit_rank"].iloc[0]) if len(v) else "–"), (i, kind)
            assert row[column + 1] == (shown(v["contribution_share"].iloc[0]) if len(v) else "–"), (i, kind)
        assert row[4] == shown(stats.at[i, "corr"]) and row[9] == shown(stats.at[i, "energy1"])
    def features() -> list[int]:  # the rows shown, as layer * 1000 + feature
        return p.eval_on_selector_all("#index-body tr", "r => r.map(x => +x.dataset.layer * 1000 + +x.dataset.feature)")

    key = [int(base.at[i, "layer"]) * 1000 + int(base.at[i, "feature"]) for i in range(len(base))]
    p.click("#index-table th[data-key='gate_rank']")  # ranks: best first
    assert features() == [key[i] for i in index_order(stats, "gate_rank", False)]
    assert p.get_attribute("#index-table th[data-key='gate_rank']", "data-dir") == "asc"
    p.click("#index-table th[data-key='gate_rank']")
    assert features() == [key[i] for i in index_order(stats, "gate_rank", True)]
    p.click("#index-table th[data-key='group_share']")  # shares: largest first
    assert features() == [key[i] for i in index_order(stats, "group_share", True)]
    p.check("#gates-only")
    ranked = [i for i in range(len(stats)) if stats.at[i, "gate_rank"] is not None or stats.at[i, "group_rank"] is not None]
    assert p.locator("#index-body tr").count() == len(ranked) < len(stats)
    p.uncheck("#gates-only")
    # the search: every word in the description or the top tokens; the planted description shown as text
    terms = ["onerror", f"sat{out}"]
    found = [key[i] for i in range(len(base))
             if all(t in f"{base.at[i, 'description']} {base.at[i, 'top_tokens_text']}".lower() for t in terms)]
    p.fill("#search", " ".join(terms))
    assert sorted(features()) == sorted(found) and layer * 1000 + out in found
    assert PLANTED in page.text(f"#index-body tr[data-layer='{layer}'][data-feature='{out}']")
    page.safe()
    p.fill("#search", "")

    # the layer page: the pairs and the group gates by circuit rank, with their verdicts
    page.go(f"#/layer/{layer}")
    assert p.locator("#hist-gate .main-svg").count() >= 1 and p.locator("#hist-group .main-svg").count() >= 1
    assert p.locator("#main [data-missing]").count() == 0
    mine = verdicts[verdicts["layer"] == layer]
    for kind in ("pair", "group"):
        ranked = mine[mine["kind"] == kind].sort_values("circuit_rank")
        rows = page.rows(f"table.best-{kind}s")
        assert len(rows) == len(ranked) > 0, kind
        for text, v in zip(rows, ranked.to_dict("records")):
            assert text.split("\t")[0] == str(v["circuit_rank"]) and f"out #{v['out_feature']}" in text
            assert v["verdict"] in text
            for label in (v["label_a"], v["label_b"]):
                if isinstance(label, str):
                    assert label + ": " in text
            assert js_number(v["contribution_share"]) in text and js_number(v["gate_score"]) in text
        tags = p.locator(f"table.best-{kind}s .tag.yes", has_text="AND")
        assert tags.count() == int(ranked["is_and"].sum()), kind
        # the corpus's gate tag (meta.gate_tags) marks the rows whose column says so
        tagged = p.locator(f"table.best-{kind}s .tag.yes", has_text="negation gate")
        assert tagged.count() == int(ranked["negation_gate"].eq(True).sum()) > 0, kind
        first = p.locator(f"table.best-{kind}s tbody tr").first
        for m in [*ranked.iloc[0]["members_a"], *ranked.iloc[0]["members_b"]]:
            assert first.locator(f"a[href='#/in/{layer}/{m}']").count() == 1, (kind, m)
    assert "verdict: " + PLANTED in page.text("table.best-pairs")
    page.safe()

    # the output feature page of the best pair: the candidate's card, its truth table and ablations
    page.go(f"#/out/{layer}/{out}")
    assert page.text("#description") == PLANTED and "<b>no</b>" in page.text("#feature .contexts")
    v = mine[(mine["out_feature"] == out) & (mine["kind"] == "pair")].iloc[0]
    assert page.text("#pair-card .verdict-text") == "verdict: " + PLANTED
    assert v["truth"] in page.text("#pair-card .truth-text")
    card = page.text("#pair-card")
    assert "circuit rank 1" in card and js_number(v["contribution_share"]) in card
    truth = source_table(run, "gate_truth", layer, "resid_mid")
    truth = truth[(truth["out_feature"] == out) & (truth["in_a"] == site.a) & (truth["in_b"] == site.b)]
    assert len(truth) == 4
    cells = page.text("#pair-card table.truth")
    for value in truth["mean_activation"]:
        assert js_number(value) in cells
    ablation = source_table(run, "gate_ablation", layer, "resid_mid")
    ablation = ablation[(ablation["out_feature"] == out) & (ablation["in_a"] == site.a)]
    rows = page.rows("#pair-card table.ablation")
    assert [r.split("\t")[0] for r in rows] == ["a", "b", "both"] == ablation["ablated"].tolist()
    for text, after in zip(rows, ablation["activation_after"]):
        assert js_number(after) in text
    assert "removes" in page.text("#pair-card .drops")
    assert p.locator(f"#pair-card h3 a[href='#/in/{layer}/{site.a}']").count() == 1
    gates = source_table(run, "gates", layer, "resid_mid")
    gates = gates[gates["out_feature"] == out]
    assert len(page.rows("table.gates")) == len(gates)
    for value in gates["input_cosine"]:
        assert js_number(value) in page.text("table.gates")
    # its group gates, members linked to their input pages
    groups = source_table(run, "group_gates", layer, "resid_mid")
    groups = groups[groups["out_feature"] == out]
    rows = page.rows("table.group-gates")
    assert len(rows) == len(groups)
    for g in groups.to_dict("records"):
        assert any(text.startswith(g["source"]) and js_number(g["contribution_share"]) in text for text in rows)
        for m in [*g["members_a"], *g["members_b"]]:
            assert p.locator(f"table.group-gates a[href='#/in/{layer}/{m}']").count() >= 1
    labels = page.text("#main .labels")
    assert "context" + PLANTED in labels and "positive" + PLANTED in labels
    assert "happy" + PLANTED in page.text(".logits") and "bad" + PLANTED in page.text(".logits")
    page.safe()

    # the output feature page of the best group gate: its card, links to every member
    page.go(f"#/out/{layer}/{site.group_out}")
    g = mine[(mine["out_feature"] == site.group_out) & (mine["kind"] == "group")].iloc[0]
    assert page.text("#group-card .verdict-text") == g["verdict"]
    heading = page.text("#group-card h3")
    for label in (g["label_a"], g["label_b"]):
        if isinstance(label, str):
            assert label in heading
    truth = source_table(run, "group_truth", layer, "resid_mid")
    truth = truth[(truth["out_feature"] == site.group_out) & (truth["group_a"] == g["group_a"])]
    for value in truth["mean_activation"]:
        assert js_number(value) in page.text("#group-card table.truth")
    assert len(page.rows("#group-card table.ablation")) == 3
    member = int(g["members_b"][0])
    for m in [*g["members_a"], *g["members_b"]]:
        assert p.locator(f"#group-card h3 a[href='#/in/{layer}/{m}']").count() == 1
    page.safe()
    # a member's input page lists the group gate it is in
    page.after_click(f"#group-card h3 a[href='#/in/{layer}/{member}']")
    assert p.evaluate("location.hash") == f"#/in/{layer}/{member}"
    assert p.locator(f"#in-groups a[href='#/out/{layer}/{site.group_out}']").count() >= 1

    # an output without a candidate of either kind says so
    none = [f for f in range(12) if not (mine["out_feature"] == f).any()]
    assert none
    page.go(f"#/out/{layer}/{none[0]}")
    assert "No circuit candidate pair" in page.text("#main") and "No ranked group gate" in page.text("#main")

    # the input page of the pair's first input: the planted description, the gate with it
    page.go(f"#/in/{layer}/{site.a}")
    assert page.text("#description") == PLANTED + " (input)"
    assert f"#/out/{layer}/{out}" in p.inner_html("#in-gates")
    page.safe()

    # the other input site: its own verdicts
    page.go(f"#/layer/{layer}?in=mlp_in")
    assert p.locator("#input-site option").count() == 2
    other = verdicts_of(run, "mlp_in", layer)
    first = other[other["kind"] == "pair"].sort_values("circuit_rank").iloc[0]
    assert f"out #{int(first['out_feature'])}" in page.rows("table.best-pairs")[0]
    assert first["verdict"] in page.rows("table.best-pairs")[0]
    assert not page.errors, page.errors
    assert all(u.startswith("file://") for u in page.requests), "the site must not use the network"


def stored(value: float) -> float:
    """A float as the data files hold it (rounded to `xdata.DIGITS` significant digits)."""
    return float(xdata.round_sig(np.array([value]))[0])


def js_fixed(value: float, digits: int) -> str:
    """JavaScript's `value.toFixed(digits)`: the double's exact decimal value, rounded half up."""
    exact = decimal.Decimal(value).quantize(decimal.Decimal(1).scaleb(-digits), rounding=decimal.ROUND_HALF_UP)
    return f"{exact:.{digits}f}"


def test_the_first_page_leads_with_each_layers_ranked_circuits(browser, synthetic_site):
    """Before the list of every feature: per layer, the best candidates of each kind in
    circuit-rank order, their gate type, causal score and and_data to two decimals, their shares
    as percentages."""
    site = synthetic_site
    page = Page(browser, site.explorer)
    p = page.page
    page.open()
    assert p.eval_on_selector("#main", "m => m.firstElementChild.id") == "ranked"
    headings = p.eval_on_selector_all("#main h1, #main h2", "h => h.map(x => x.id)")
    assert headings[:3] == ["ranked", "ranked-L0", "ranked-L1"] and headings.index("all-features") == 3
    verdicts = schemas.select(read_table(site.tables, "gate_verdicts"), "resid_mid")
    for layer in (0, 1):
        cells = p.eval_on_selector_all(f"table.ranked[data-layer='{layer}'] tbody tr",
                                       "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
        want = []
        for kind in ("pair", "group"):
            best = verdicts[(verdicts["layer"] == layer) & (verdicts["kind"] == kind)].sort_values("circuit_rank")
            best = best.drop_duplicates("out_feature").head(5)  # an output's candidate: its best by rank
            want += [[str(r.circuit_rank), f"out #{r.out_feature}", r.gate_type, js_fixed(stored(r.causal_score), 2),
                      js_fixed(100 * stored(r.contribution_share), 1) + "%",
                      js_fixed(100 * stored(r.coactivation), 1) + "%", js_fixed(stored(r.and_data), 2)]
                     for r in best.itertuples()]
        got = [[row[1], row[2].split(" ")[0] + " " + row[2].split(" ")[1], *row[5:10]] for row in cells]
        assert got == want, layer
    # frequencies read as percentages with two significant digits below 1%
    base = xdata.decode_table(load_data(site.paths, "index")["features"])
    first = p.eval_on_selector("#index-body tr", "r => r.cells[3].textContent")
    value = 100 * float(base.at[0, "frequency"])
    assert first == (f"{value:.1f}%" if value >= 1 else f"{float(f'{value:.2g}'):g}%")
    assert not page.errors, page.errors


def test_the_first_page_describes_each_sides_inputs(browser, synthetic_site):
    """Issue 51, item 23: the ranked circuits listed each side's inputs as bare ids (`in #332`);
    each now carries its short description from the features table, as the report does."""
    site = synthetic_site
    page = Page(browser, site.explorer)
    p = page.page
    page.open()
    features = read_table(site.tables, "features")
    inputs = features[features["site"] == "resid_mid"]
    desc = {(int(r.layer), int(r.feature)): r.description for r in inputs.itertuples()}
    seen = 0
    for layer in (0, 1):
        sides = p.eval_on_selector_all(f"table.ranked[data-layer='{layer}'] tbody tr", """rows => rows.flatMap(r =>
            [r.cells[3], r.cells[4]].flatMap(c => [...c.querySelectorAll('a.feat')].map(a =>
                [a.textContent, a.nextElementSibling && a.nextElementSibling.classList.contains('desc')
                    ? a.nextElementSibling.textContent : null])))""")
        for text, shown in sides:
            want = desc.get((layer, int(text.split("#")[1])))
            if want:
                seen += 1
                assert shown and (shown == want or (shown.endswith("…") and want.startswith(shown[:-1]))), (text, shown)
    assert seen > 0 and not page.errors, page.errors


def test_layers_whose_verdicts_were_not_run_say_so_in_a_browser(browser, synthetic_site, tmp_path):
    run = RunPaths(tmp_path / "run")
    shutil.copytree(synthetic_site.paths.root, run.root)
    for path in (run.tables / "gate_verdicts").rglob("*.parquet"):
        if path.parent.name == "layer1":
            path.unlink()
    write_explorer(run)
    page = Page(browser, run.explorer)
    p = page.page
    page.open()
    assert p.locator("table.ranked[data-layer='0']").count() == 1
    assert p.locator("table.ranked[data-layer='1']").count() == 0
    assert "Verdicts not run for this layer" in page.text("#main")
    page.go("#/layer/1")
    assert "verdicts not run for this layer" in page.text("#main")
    assert "No ranked candidates" not in page.text("#main")
    assert not page.errors, page.errors


def verdicts_of(run: RunPaths, site: str, layer: int) -> pd.DataFrame:
    return schemas.select(read_table(run.tables, "gate_verdicts", [layer]), site)


def test_missing_verdicts_are_marked_in_a_browser(browser, tmp_path):
    """A run whose verdicts stage has not run: the circuits are shown, every place that
    needs the verdicts' tables says which is missing."""
    verdict_tables = ("gate_verdicts", "group_gates", "group_truth", "gate_ablation", "group_ablation")
    run = synthetic_run(tmp_path / "partial", layers=(0,), skip=verdict_tables)
    write_explorer(run)
    page = Page(browser, run.explorer)
    p = page.page
    page.open()
    assert p.locator("#main [data-missing='gate_verdicts']").count() == 1
    assert set(p.eval_on_selector_all("#index-body tr td:nth-child(6)", "c => c.map(x => x.textContent)")) == {"–"}
    page.go("#/layer/0")
    assert p.locator("#main [data-missing='gate_verdicts']").count() >= 1
    assert p.locator("table.best-pairs").count() == 0
    page.go("#/out/0/0")
    for name in ("gate_verdicts", "group_gates"):
        assert p.locator(f"#main [data-missing='{name}']").count() >= 1, name
    assert p.locator("table.gates").count() >= 1 and p.locator("table.interactions").count() >= 1
    page.go("#/in/0/1")
    assert p.locator("#main [data-missing='group_gates']").count() == 1
    # the verdicts without the tables of the circuit candidates' truth tables and ablations
    run = synthetic_run(tmp_path / "partial2", layers=(0,), skip=("gate_truth", "gate_ablation", "gates"))
    write_explorer(run)
    page2 = Page(browser, run.explorer)
    verdicts = verdicts_of(run, "resid_mid", 0)
    out = int(verdicts[(verdicts["kind"] == "pair") & (verdicts["circuit_rank"] == 1)]["out_feature"].iloc[0])
    page2.open(f"#/out/0/{out}")
    for name in ("gates", "gate_truth", "gate_ablation"):
        assert page2.page.locator(f"#main [data-missing='{name}']").count() == 1, name
    assert page2.page.locator("#pair-card .verdict-text").count() == 1  # the verdict is still shown
    # features only (the circuits stage has not run): no input site, no circuit data files asked for
    run = synthetic_run(tmp_path / "features-only", layers=(0,), skip=(*xdata.LAYER_TABLES, "hosvd"))
    write_explorer(run)
    assert load_data(run, "meta")["input_sites"] == []
    page3 = Page(browser, run.explorer)
    page3.open("#/out/0/0")
    for name in ("interactions", "eigen", "lowrank", "gates", "gate_verdicts", "group_gates"):
        assert page3.page.locator(f"#main [data-missing='{name}']").count() >= 1, name
    assert page3.text("#description") == "mlp_out feature 0 on sat0"
    page3.go("#/layer/0")
    assert page3.page.locator("#main [data-missing='gate_verdicts']").count() >= 1
    page3.go("#/in/0/1")
    assert page3.text("#description") == "resid_mid feature 1 on sat1"
    assert not any("_L0_" in u for u in page3.requests)
    assert not page.errors and not page2.errors and not page3.errors, page.errors + page2.errors + page3.errors


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The small demo (every stage, explorer included), with a planted description on the
    output feature of the last layer's best circuit candidate pair and on one of its inputs,
    and a planted verdict. EXPLORER_TEST_RUN=DIR reuses the tables of a finished small demo
    in DIR instead (copied; for working on the explorer)."""
    from pipelines.demo import DemoConfig, run_demo
    from pipelines.runtime import Runtime

    run = RunPaths(tmp_path_factory.mktemp("explorer_demo"))
    reuse = os.environ.get("EXPLORER_TEST_RUN")
    if reuse:
        shutil.copytree(RunPaths(reuse).tables, run.tables)
        write_explorer(run)
    else:
        run_demo(run, DemoConfig.small(), Runtime(threads=1, device="cpu"))
    assert (run.explorer / "index.html").is_file()
    verdicts = schemas.select(read_table(run.tables, "gate_verdicts"))
    best = verdicts[(verdicts["kind"] == "pair") & eq(verdicts["circuit_rank"], 1)].sort_values("layer").iloc[-1]
    layer, out, a = int(best["layer"]), int(best["out_feature"]), int(best["in_a"])
    plant(run, layer, "mlp_out", out, PLANTED, PLANTED_CONTEXT)
    plant(run, layer, "resid_mid", a, PLANTED + " (input)")
    plant_verdict(run, layer, "resid_mid", out, "verdict: " + PLANTED)
    start = time.perf_counter()
    write_explorer(run)
    return SimpleNamespace(paths=run, tables=run.tables, explorer=run.explorer, build_s=time.perf_counter() - start,
                           best=(layer, out, a, int(best["in_b"])))


@pytest.mark.slow
def test_explorer_in_a_browser(browser, demo_run):  # browser first: its skip saves the demo
    run = demo_run
    layer, out, a, b = run.best
    site = run.explorer
    size = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
    timings = {}
    shots = Path(os.environ.get("EXPLORER_SHOTS") or tempfile.mkdtemp(prefix="explorer-shots-"))
    shots.mkdir(parents=True, exist_ok=True)
    page = Page(browser, site)
    p = page.page
    verdicts = schemas.select(read_table(run.tables, "gate_verdicts"))

    # the index: every output feature, searchable, filterable and sortable
    timings["index (cold)"] = page.open()
    features = read_table(run.tables, "features")
    outs = features[features["site"] == "mlp_out"]
    assert p.locator("#index-body tr").count() == min(200, len(outs))
    assert f"{len(outs)} output features in all" in page.text("#index-count")
    assert p.eval_on_selector_all("#index-table th", "t => t.map(x => x.dataset.key)") == INDEX_KEYS
    p.screenshot(path=str(shots / "index.png"))
    token = outs.loc[outs["top_token"].notna(), "top_token"].value_counts().index[0]
    p.fill("#search", token)
    rows = p.locator("#index-body tr")
    assert 0 < rows.count() < len(outs)
    for text in rows.all_inner_texts():
        assert token.lower() in text.lower()
    p.fill("#search", "")
    p.select_option("#layer-filter", str(layer))
    layers = p.eval_on_selector_all("#index-body tr", "rows => rows.map(r => r.dataset.layer)")
    assert set(layers) == {str(layer)} and len(layers) == int((outs["layer"] == layer).sum())
    p.click("#index-table th[data-key='corr']")
    values = [float(v) for v in p.eval_on_selector_all("#index-body tr td:nth-child(5)", "c => c.map(x => x.textContent)")
              if v != "–"]
    assert values == sorted(values, reverse=True) and values
    # by pair rank: the layer's circuit candidate pairs in rank order, then the outputs without one
    p.click("#index-table th[data-key='gate_rank']")
    pairs = verdicts[(verdicts["layer"] == layer) & (verdicts["kind"] == "pair")].sort_values("circuit_rank")
    pairs = pairs.drop_duplicates("out_feature")  # an output's candidate; its demoted split pairs rank later
    ids = p.eval_on_selector_all("#index-body tr", "rows => rows.map(r => +r.dataset.feature)")
    assert ids[:len(pairs)] == pairs["out_feature"].tolist()
    ranks = p.eval_on_selector_all("#index-body tr td:nth-child(6)", "c => c.map(x => x.textContent)")
    assert ranks[:len(pairs)] == [str(r) for r in pairs["circuit_rank"]] and set(ranks[len(pairs):]) <= {"–"}
    p.select_option("#layer-filter", "all")
    p.fill("#search", "pwned")  # the planted description is found, and shown as text
    assert p.locator("#index-body tr").count() == 1
    assert "<script>" in page.text("#index-body")
    page.safe()

    # the output feature page, by clicking through from the index (once the index has had the
    # second or so it takes to start Plotly in the background, as it has for a reader)
    p.wait_for_function("window.Plotly !== undefined", timeout=30000)
    timings["output feature (from the index)"] = page.after_click(f"#index-body tr[data-feature='{out}'] td:nth-child(2) a")
    assert p.evaluate("location.hash") == f"#/out/{layer}/{out}"
    assert page.text("#description") == PLANTED
    page.safe()
    assert "<b>no</b>" in page.text("#feature .contexts")  # the planted context, as text
    assert p.locator("#feature mark").count() >= 1
    row = features[(features["layer"] == layer) & (features["site"] == "mlp_out") & (features["feature"] == out)].iloc[0]
    body = page.text("#main")
    assert js_number(row["frequency"]) in body
    for tok in row["boosted_tokens"]:
        assert tok in page.text(".logits")
    inter = schemas.select(read_table(run.tables, "interactions", [layer]))
    mine = inter[inter["out_feature"] == out]
    top_cross = mine[mine["kind"] == "cross"].sort_values("rank").iloc[0]
    assert js_number(top_cross["coefficient"]) in page.text("table.interactions")
    eigen = schemas.select(read_table(run.tables, "eigen", [layer]))
    top_eig = eigen[(eigen["out_feature"] == out) & (eigen["rank"] == 1)].iloc[0]
    assert js_number(top_eig["eigenvalue"]) in body
    lowrank = schemas.select(read_table(run.tables, "lowrank", [layer]))
    corr = lowrank[(lowrank["out_feature"] == out) & (lowrank["n_eigs"] == 2)]["corr_active"].iloc[0]
    if math.isfinite(corr):
        assert js_number(corr) in page.text("table.lowrank")
    gates = schemas.select(read_table(run.tables, "gates", [layer]))
    best = gates[(gates["out_feature"] == out) & (gates["in_a"] == a) & (gates["in_b"] == b)].iloc[0]
    assert js_number(best["contribution_share"]) in " ".join(p.locator("table.gates").all_text_contents())
    # the circuit candidate's card: the verdict from gate_verdicts, its truth table and ablations
    v = verdicts[(verdicts["layer"] == layer) & (verdicts["out_feature"] == out) & (verdicts["kind"] == "pair")].iloc[0]
    assert page.text("#pair-card .verdict-text") == "verdict: " + PLANTED
    assert v["truth"] in page.text("#pair-card .truth-text") and "circuit rank 1" in page.text("#pair-card")
    truth = schemas.select(read_table(run.tables, "gate_truth", [layer]))
    truth = truth[(truth["out_feature"] == out) & (truth["in_a"] == a) & (truth["in_b"] == b)]
    if len(truth):
        assert p.locator("#pair-card table.truth").count() == 1
        for value in truth["mean_activation"]:
            assert js_number(value) in page.text("#pair-card table.truth")
    ablation = schemas.select(read_table(run.tables, "gate_ablation", [layer]))
    ablation = ablation[(ablation["out_feature"] == out) & (ablation["in_a"] == a) & (ablation["in_b"] == b)]
    assert len(ablation) == 3  # the best candidates are ablated
    rows = page.rows("#pair-card table.ablation")
    assert [r.split("\t")[0] for r in rows] == ablation.sort_values("ablated")["ablated"].tolist()
    for value in ablation["activation_after"]:
        assert js_number(value) in page.text("#pair-card table.ablation")
    # its group gates, members linked
    groups = schemas.select(read_table(run.tables, "group_gates", [layer]))
    groups = groups[groups["out_feature"] == out]
    assert len(page.rows("table.group-gates")) == len(groups)
    for g in groups.head(3).to_dict("records"):
        for m in [*g["members_a"], *g["members_b"]]:
            assert p.locator(f"table.group-gates a[href='#/in/{layer}/{m}']").count() >= 1
    group = verdicts[(verdicts["layer"] == layer) & (verdicts["out_feature"] == out) & (verdicts["kind"] == "group")]
    assert p.locator("#group-card").count() == len(group)
    if len(group):
        assert page.text("#group-card .verdict-text") == group["verdict"].iloc[0]
    assert p.locator("#heatmap .main-svg").count() >= 1 and p.locator("#spectrum .main-svg").count() >= 1
    # the scatter of sampled tokens: as many points per rank as the table holds for the feature
    samples = schemas.select(read_table(run.tables, "lowrank_samples", [layer]))
    samples = samples[samples["out_feature"] == out]
    points = p.evaluate("document.getElementById('samples-plot').data.filter(t => t.mode === 'markers').map(t => t.x.length)")
    assert points and set(points) == {int((samples["n_eigs"] == 1).sum())}
    # hover a heatmap cell: the pair and its coefficient; click it: links to both inputs
    cell = p.evaluate("""() => {
        const el = document.getElementById('heatmap'), t = el.data[0], xa = el._fullLayout.xaxis, ya = el._fullLayout.yaxis;
        for (let i = 0; i < t.z.length; i++) for (let j = 0; j < t.z.length; j++) if (i !== j && t.z[i][j] !== null) {
            const box = el.getBoundingClientRect();
            return {x: box.left + xa._offset + xa.l2p(j), y: box.top + ya._offset + ya.l2p(i), coef: t.z[i][j], ids: t.customdata[i][j]};
        }
        return null; }""")
    if cell is not None:
        p.mouse.move(cell["x"], cell["y"])
        p.wait_for_selector(".hoverlayer .hovertext", timeout=5000)
        hover = p.text_content(".hoverlayer")
        assert js_number(cell["coef"]) in hover and f"in #{cell['ids'][0]}" in hover
        p.mouse.click(cell["x"], cell["y"])
        p.wait_for_selector("#heatmap-pick a")
        assert f"/in/{layer}/{cell['ids'][0]}" in p.inner_html("#heatmap-pick")
    page.safe()
    p.screenshot(path=str(shots / "feature.png"), full_page=True)

    # a link to an input feature: the planted input description, and it builds the output we came from
    timings["input feature (link)"] = page.after_click(f"#pair-card h3 a[href='#/in/{layer}/{a}']")
    assert p.evaluate("location.hash") == f"#/in/{layer}/{a}"
    assert page.text("#description") == PLANTED + " (input)"
    assert f"#/out/{layer}/{out}" in p.inner_html("#in-gates")
    uses = inter[((inter["in_a"] == a) | (inter["in_b"] == a)) & (inter["kind"] != "constant")]
    if len(uses):
        strongest = uses.loc[uses["coefficient"].abs().idxmax()]
        assert js_number(strongest["coefficient"]) in page.text("table.builds")
    all_groups = schemas.select(read_table(run.tables, "group_gates", [layer]))
    member_of = all_groups[[a in set(m1) | set(m2) for m1, m2 in zip(all_groups["members_a"], all_groups["members_b"])]]
    assert len(page.rows("table.in-groups")) == min(50, len(member_of))
    page.safe()

    # the layer page: distributions and the circuit candidates by circuit rank, with verdicts
    timings["layer"] = page.go(f"#/layer/{layer}")
    assert p.locator("#hist-corr .main-svg").count() >= 1
    mine = verdicts[verdicts["layer"] == layer]
    for kind in ("pair", "group"):
        ranked = mine[mine["kind"] == kind].sort_values("circuit_rank")
        rows = page.rows(f"table.best-{kind}s")
        assert len(rows) == min(100, len(ranked)), kind
        first = ranked.iloc[0]
        assert f"out #{int(first['out_feature'])}" in rows[0] and js_number(first["contribution_share"]) in rows[0]
        assert first["verdict"] in rows[0]
    assert "verdict: " + PLANTED in page.text("table.best-pairs")
    page.safe()
    p.screenshot(path=str(shots / "layer.png"), full_page=True)

    # feature ids that do not exist, and routes that do not exist
    for bad in (f"#/out/{layer}/99999", "#/out/77/0", f"#/in/{layer}/-3", "#/out/x/y", "#/nowhere"):
        page.go(bad)
        assert p.locator("#not-found").count() == 1, bad
        assert "Not found" in page.text("#not-found")
    timings["not found"] = page.go(f"#/out/{layer}/99999")
    assert "99999" in page.text("#not-found")

    # a fresh document opened straight on a feature page (Plotly starts up with it)
    cold = Page(browser, site)
    timings["output feature (cold)"] = cold.open(f"#/out/{layer}/{out}")
    timings["output feature (warm)"] = cold.go(f"#/out/{layer}/{0 if out else 1}")
    timings["index (back)"] = cold.go("#/")

    assert not page.errors and not cold.errors, page.errors + cold.errors
    assert all(u.startswith("file://") for u in page.requests + cold.requests), "the site must not use the network"
    report = {k: {"ms": round(v["ms"]), "content_ms": round(v.get("content", v["ms"]))} for k, v in timings.items()}
    print(f"\nexplorer: {size / 1e6:.1f} MB, rebuilt in {run.build_s:.1f} s; render times: {json.dumps(report)}")
    assert size < 50e6 and run.build_s < 60
    for name, t in timings.items():
        assert t.get("content", t["ms"]) < BUDGET_MS, (name, t)  # text and tables on screen
        if "cold" not in name:
            assert t["ms"] < BUDGET_MS, (name, t)  # everything, plots included
    # a cold document also waits for Plotly's own start-up (about a second on a busy 2-core machine)
    assert timings["output feature (cold)"]["ms"] < 2.5 * BUDGET_MS


@pytest.mark.slow
def test_explorer_marks_missing_tables_in_a_browser(browser, demo_run, tmp_path):
    run = RunPaths(tmp_path / "partial")
    shutil.copytree(demo_run.tables, run.tables)
    removed = ("eigen", "eigen_inputs", "gates", "feature_labels", "group_gates", "gate_truth")
    for name in removed:
        shutil.rmtree(run.tables / name)
    write_explorer(run)
    layer, out = demo_run.best[:2]
    page = Page(browser, run.explorer)
    page.open(f"#/out/{layer}/{out}")
    p = page.page
    for name in removed:
        assert p.locator(f"#main [data-missing='{name}']").count() >= 1, name
    assert "Missing: the eigen table (not in this run)" in page.text("#main")
    assert p.locator("table.interactions").count() >= 1  # what is there is still shown
    assert page.text("#pair-card .verdict-text") == "verdict: " + PLANTED  # the verdicts need none of them
    page.go(f"#/layer/{layer}")
    assert p.eval_on_selector_all("#main [data-missing]", "m => m.map(x => x.dataset.missing)") == ["eigen"]
    assert p.locator("table.best-pairs").count() == 1 and p.locator("table.best-groups").count() == 1
    page.go("#/")
    assert p.locator("#main [data-missing='eigen']").count() == 1
    assert p.locator("#main [data-missing]").count() == 1
    # without the verdicts stage's tables
    for name in ("gate_verdicts", "group_truth", "gate_ablation", "group_ablation"):
        shutil.rmtree(run.tables / name)
    write_explorer(run)
    page.open(f"#/layer/{layer}")
    assert p.locator("#main [data-missing='gate_verdicts']").count() >= 1
    page.go("#/")
    assert p.locator("#main [data-missing='gate_verdicts']").count() == 1
    page.go(f"#/out/{layer}/{out}")
    assert p.locator("#main [data-missing='gate_verdicts']").count() == 2  # the pair's and the group's card
    assert not page.errors, page.errors
