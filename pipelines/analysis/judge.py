"""One layer's verdicts, end to end: cache the layer's held-out tokens once, measure the group
gates, test every pair and group gate by exact intervention, type and rank them, confirm the
best in the model on tokens the ranking never read, and judge them (the rules are in
`circuits.gates`, the tables' wording in `pipelines.analysis.verdicts`). The verdicts stage
writes what this returns; the planted benchmark calls it on a model built by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from circuits.forward import Streams
from circuits.gates.interventions import LayerIntervention, Sides
from circuits.weights import from_hooked_transformer
from pipelines.analysis.ablation import confirm
from pipelines.analysis.group_gates import group_tables
from pipelines.analysis.interventions import (LayerCache, columns_of, intervention_columns, pruned_groups,
                                              ranking_entries, retested, side_lists)
from pipelines.analysis.verdicts import (CIRCUIT_SIDES, InputFacts, VerdictConfig, ablation_key, pair_candidates,
                                         pair_split_evidence, rank, to_ablate, verdict_rows)
from pipelines.data.tags import GateTag
from pipelines.data.tokens import TokenRows
from pipelines.inputs import LayerSAEs
from pipelines.schemas import TABLES

CIRCUIT_READS = ("gates", "eigen", "eigen_inputs", "interactions")  # the circuits stage's tables it reads


def judge_layer(model, saes: LayerSAEs, rows: TokenRows, circuits: dict[str, pd.DataFrame], *, facts: InputFacts,
                tags: tuple[GateTag, ...], boosted: dict[int, list[int]], cfg: VerdictConfig,
                streams: Streams | None = None) -> dict[str, pd.DataFrame]:
    """The `pair_gates`, `gate_ablation`, `group_gates`, `group_truth`, `group_ablation` and
    `gate_verdicts` rows of one layer, from its circuit tables (`CIRCUIT_READS`, output SAE
    features, this input site), what the features say (`facts`), and held-out `rows`.
    `tags`: the corpus's gate tags whose channels the feature labels carry (`pipelines.data.tags`),
    a column each. `streams`: the rows' residual streams kept from an earlier layer
    (`forward.Streams`), so the token cache runs one block."""
    layer = saes.layer
    mlp = from_hooked_transformer(model, layer)
    sae_in, sae_out = saes.sae_in.weights, saes.sae_out.weights
    cache = LayerCache.build(model, rows, cfg.rows, saes, cfg.seed, cfg.confirm_share, streams=streams)
    local = LayerIntervention(mlp.to(sae_in.W_dec.dtype), sae_in.W_dec, sae_out, saes.input_site)
    keys = {"layer": layer, "outputs": "sae", "input_site": saes.input_site}

    pairs = pair_candidates(circuits["gates"], circuits["interactions"], cfg)
    device = cache.source.device  # the candidates' sides live where the token cache does
    pair_sides = Sides.of_pairs(*(torch.tensor(pairs[c].to_numpy(dtype=np.int64), device=device)
                                  for c in ("out_feature", "in_a", "in_b")))
    pairs = pd.concat([pairs, intervention_columns(local, cache, pair_sides, ranking_entries(cache, pair_sides, cfg),
                                                   cfg)], axis=1)
    same, pair_evidence = pair_split_evidence(pairs, facts, cfg)
    rank_pairs = lambda frame: rank(frame, pair_evidence, ["in_a", "in_b"], cfg)  # noqa: E731
    pairs = retested(local, cache, rank_pairs(pairs.assign(same_top_token=same)), pair_sides, rank_pairs, cfg)
    pairs = pairs.assign(**keys)

    group_gates, group_truth = group_tables(
        mlp, sae_in, sae_out.W_enc.T, input_site=saes.input_site, layer=layer, eigen=circuits["eigen"],
        eigen_inputs=circuits["eigen_inputs"], interactions=circuits["interactions"], facts=facts,
        batches=cache.batches(), cfg=cfg)
    if len(group_gates):
        group_sides = Sides.of_groups(group_gates["out_feature"].tolist(), list(group_gates["members_a"]),
                                      list(group_gates["members_b"]), device)
        group_sides, table = pruned_groups(local, cache, group_sides, cfg)
        group_gates = pd.concat([group_gates.reset_index(drop=True), columns_of(table, cfg)],
                                axis=1).assign(**side_lists(group_sides))
        group_evidence = group_gates["split_pair"].to_numpy(dtype=bool)  # the split rule's evidence (group_tables)
        rank_groups = lambda frame: rank(frame, group_evidence, ["group_a", "group_b"], cfg)  # noqa: E731
        group_gates = retested(local, cache, rank_groups(group_gates), group_sides, rank_groups, cfg)
    group_gates, group_truth = (f.assign(**keys) for f in (group_gates, group_truth))

    first = verdict_rows(pairs, group_gates, None, None, facts, cfg, tags)
    ablated, tried = {}, set()
    for kind, table, key in (("pair", "gate_ablation", ("in_a", "in_b")),
                             ("group", "group_ablation", ("group_a", "group_b"))):
        chosen = to_ablate(first, kind, cfg.n_ablate, tags) if len(first) else first
        tried.update(ablation_key(r) for r in chosen.to_dict("records"))
        a, b = CIRCUIT_SIDES[kind]
        sides = Sides.of_groups(chosen["out_feature"].astype(int).tolist(),
                                [list(m) for m in chosen[a]], [list(m) for m in chosen[b]], device) \
            if len(chosen) else Sides.of_groups([], [], [], device)
        names = [{"out_feature": int(r["out_feature"]), **{k: int(r[k]) for k in key}} for r in chosen.to_dict("records")]
        frame = confirm(model, cache, saes, mlp, sides, names, boosted=boosted, max_tokens=cfg.ablate_tokens,
                        seed=cfg.seed)
        ablated[table] = frame.assign(**keys) if len(frame) else TABLES[table].empty()
    verdicts = verdict_rows(pairs, group_gates, ablated["gate_ablation"], ablated["group_ablation"], facts, cfg, tags,
                            frozenset(tried))
    # a verdict row carries its candidate's working columns (ranks, cross terms): keep the table's; a layer
    # without verdicts has the tags' columns too, or a reader of every layer's files could drop them
    table = TABLES["gate_verdicts"].schema_with(tag.column for tag in tags)
    verdicts = verdicts.assign(**keys)[table.names] if len(verdicts) else table.empty_table().to_pandas()
    pairs = pairs[TABLES["pair_gates"].names] if len(pairs) else TABLES["pair_gates"].empty()
    return {**ablated, "pair_gates": pairs, "group_gates": group_gates, "group_truth": group_truth,
            "gate_verdicts": verdicts}

