"""One layer's verdicts, end to end: rank the pairs, measure the group gates on held-out
tokens, ablate the best candidates in the model, and judge them (the rules are in
`pipelines.analysis.verdicts`). The verdicts stage writes what this returns; the planted
benchmark calls it on a model built by hand."""

from __future__ import annotations

import pandas as pd

from circuits.weights import from_hooked_transformer
from pipelines.analysis.ablation import Target, ablations
from pipelines.analysis.groups import group_tables
from pipelines.analysis.verdicts import InputFacts, VerdictConfig, rank_pairs, to_ablate, verdict_rows
from pipelines.data.tokens import TokenRows
from pipelines.inputs import LayerSAEs, layer_batches
from pipelines.schemas import TABLES

CIRCUIT_READS = ("gates", "eigen", "eigen_inputs", "interactions")  # the circuits stage's tables it reads


def judge_layer(model, saes: LayerSAEs, rows: TokenRows, circuits: dict[str, pd.DataFrame], *, facts: InputFacts,
                negation: bool, boosted: dict[int, list[int]], cfg: VerdictConfig) -> dict[str, pd.DataFrame]:
    """The `gate_ablation`, `group_gates`, `group_truth`, `group_ablation` and `gate_verdicts`
    rows of one layer, from its circuit tables (`CIRCUIT_READS`, output SAE features, this
    input site), what the features say (`facts`), and held-out `rows`. `negation`: whether
    the feature labels carry the channels the negation-gate rule reads (else that column is
    null, `has_negation_labels`)."""
    layer = saes.layer
    mlp = from_hooked_transformer(model, layer)
    outputs = saes.sae_out.weights
    directions = outputs.W_enc.T
    pairs = rank_pairs(circuits["gates"], facts, cfg)
    group_gates, group_truth = group_tables(
        mlp, saes.sae_in.weights, directions, input_site=saes.input_site, layer=layer, eigen=circuits["eigen"],
        eigen_inputs=circuits["eigen_inputs"], interactions=circuits["interactions"], facts=facts,
        batches=layer_batches(model, rows, cfg.rows, saes), cfg=cfg)
    keys = {"layer": layer, "outputs": "sae", "input_site": saes.input_site}
    pairs, group_gates, group_truth = (f.assign(**keys) for f in (pairs, group_gates, group_truth))
    first = verdict_rows(pairs, group_gates, None, None, facts, cfg)
    ablated = {}
    for kind, table, key in (("pair", "gate_ablation", ("in_a", "in_b")),
                             ("group", "group_ablation", ("group_a", "group_b"))):
        chosen = to_ablate(first, kind, cfg.n_ablate, negation) if len(first) else first
        targets = [Target(int(r["out_feature"]), tuple(r["members_a"]), tuple(r["members_b"]),
                          (("out_feature", int(r["out_feature"])), *((k, int(r[k])) for k in key)))
                   for r in chosen.to_dict("records")]
        frame = ablations(model, layer, saes, mlp, directions, targets, boosted=boosted, rows=rows,
                          n_rows=cfg.ablate_rows, max_tokens=cfg.ablate_tokens, seed=cfg.seed)
        ablated[table] = frame.assign(**keys) if len(frame) else TABLES[table].empty()
    verdicts = verdict_rows(pairs, group_gates, ablated["gate_ablation"], ablated["group_ablation"], facts, cfg)
    if not negation and len(verdicts):
        verdicts["negation_gate"] = None
    # a verdict row carries its candidate's working columns (ranks, cross terms): keep the table's
    verdicts = verdicts.assign(**keys)[TABLES["gate_verdicts"].names] if len(verdicts) else TABLES["gate_verdicts"].empty()
    return {**ablated, "group_gates": group_gates, "group_truth": group_truth, "gate_verdicts": verdicts}
