"""Group gates of one layer: form the groups, measure them on held-out tokens, and write
them as the `group_gates` and `group_truth` rows, before interventions and ranking (see
`pipelines.analysis.verdicts` for the rules and `circuits.gates.groups` for the statistics)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from circuits.gates.pairs import CELLS, pair_coefficients
from circuits.gates.groups import GroupResult, GroupStats, ReadSetStats, pair_slots
from circuits.layer import LayerBatch
from circuits.sae_basis import input_basis
from circuits.sites import input_gain
from circuits.weights import MLPWeights, SAEWeights
from circuits.gates.ranking import split_evidence
from pipelines.analysis.verdicts import LABEL_JOIN, InputFacts, VerdictConfig, label_candidates, reading_sets
from pipelines.schemas import TABLES


def group_tables(mlp: MLPWeights, sae_in: SAEWeights, directions: torch.Tensor, *, input_site: str, layer: int,
                 eigen: pd.DataFrame, eigen_inputs: pd.DataFrame, interactions: pd.DataFrame | None,
                 facts: InputFacts, batches: Callable[[], Iterable[LayerBatch]], cfg: VerdictConfig
                 ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`group_gates` and `group_truth` rows of one layer (columns as in `pipelines.schemas`)."""
    device = mlp.W_gate.device
    mlp, sae_in = mlp.to(torch.float64, device), sae_in.to(torch.float64, device)
    directions = directions.to(device, torch.float64)
    basis = input_basis(sae_in.W_dec, sae_in.b_dec, input_gain(input_site, mlp.g))
    n_in = basis.shape[1] - 1
    sets = reading_sets(eigen, eigen_inputs, cfg) if "eigen" in cfg.groups else _no_sets()
    groups = facts.classes if "labels" in cfg.groups else {}
    labelled = label_candidates(groups, sets, interactions, cfg) if groups else pd.DataFrame()
    read_stats = _read_set_stats(mlp, basis, directions, sets, cfg.max_members, n_in) if len(sets) else None
    group_stats = None
    if len(labelled):
        sides = [_disjoint(groups[a], groups[b]) for a, b in zip(labelled["label_a"], labelled["label_b"])]
        labelled = _one_row_per_gate(labelled.assign(members_a=[a for a, _ in sides], members_b=[b for _, b in sides]))
        labelled = labelled[(labelled["members_a"].map(len) > 0) & (labelled["members_b"].map(len) > 0)]
        sides = list(zip(labelled["members_a"], labelled["members_b"]))
        distinct = sorted({tuple(m) for side in sides for m in side})
        membership = torch.zeros(n_in, len(distinct), dtype=torch.bool, device=device)
        for g, members in enumerate(distinct):
            membership[list(members), g] = True
        index = {members: g for g, members in enumerate(distinct)}
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        group_stats = GroupStats(as_tensor(labelled["out_feature"].tolist()),
                                 as_tensor([index[tuple(a)] for a, _ in sides]),
                                 as_tensor([index[tuple(b)] for _, b in sides]), membership, basis,
                                 mlp.W_gate, mlp.W_in, directions @ mlp.W_out.T)
    if read_stats is not None or group_stats is not None:
        for batch in tqdm(batches(), desc=f"layer {layer} groups", unit="batch"):
            for stats in (read_stats, group_stats):
                if stats is not None:
                    stats.update(batch.z.to(device), batch.scale.to(device), batch.acts.to(device))
    frames = []
    if read_stats is not None:
        frames.append(_eigen_frame(read_stats, sets, basis, facts, cfg))
    if group_stats is not None:
        frames.append(_gate_frame(group_stats.result(), cfg, source="labels", out_feature=labelled["out_feature"],
                                  eigen_rank=pd.NA, members_a=labelled["members_a"], members_b=labelled["members_b"],
                                  label_a=labelled["label_a"], label_b=labelled["label_b"], split_share=np.nan,
                                  split_pair=False))
    if not frames:
        return TABLES["group_gates"].empty(), TABLES["group_truth"].empty()
    gates = pd.concat(frames, ignore_index=True)
    gates = _one_row_per_pair_of_groups(_with_group_ids(gates))
    truth = gates.explode("cells")[["out_feature", "group_a", "group_b", "cells"]]
    truth = pd.concat([truth.drop(columns="cells").reset_index(drop=True),
                       pd.DataFrame(truth["cells"].tolist(), columns=["cell", "n_tokens", "mean_activation",
                                                                      "active_share"])], axis=1)
    return gates.drop(columns="cells").assign(layer=layer), truth.assign(layer=layer)


def _disjoint(a: list[int], b: list[int]) -> tuple[list[int], list[int]]:
    """Two label groups without common members: an input in both stays in the smaller only."""
    both = set(a) & set(b)
    if len(a) <= len(b):
        return list(a), [m for m in b if m not in both]
    return [m for m in a if m not in both], list(b)


def _one_row_per_gate(labelled: pd.DataFrame) -> pd.DataFrame:
    """Label gates whose groups are the same once `_disjoint` has taken the shared inputs out
    of the larger class are one gate: keep one row, each side named by every class it came
    from, joined with `LABEL_JOIN`."""
    merged: dict[tuple, tuple[set[str], set[str]]] = {}
    for out, la, lb, ma, mb in zip(labelled["out_feature"], labelled["label_a"], labelled["label_b"],
                                   labelled["members_a"], labelled["members_b"]):
        key = (int(out), tuple(ma), tuple(mb))
        if key not in merged and (int(out), tuple(mb), tuple(ma)) in merged:
            key, la, lb = (int(out), tuple(mb), tuple(ma)), lb, la
        names_a, names_b = merged.setdefault(key, (set(), set()))
        names_a.add(la)
        names_b.add(lb)
    return pd.DataFrame([(out, LABEL_JOIN.join(sorted(na)), LABEL_JOIN.join(sorted(nb)), list(ma), list(mb))
                         for (out, ma, mb), (na, nb) in merged.items()],
                        columns=["out_feature", "label_a", "label_b", "members_a", "members_b"])


def _one_row_per_pair_of_groups(gates: pd.DataFrame) -> pd.DataFrame:
    """One row per output and pair of groups (either order): a label gate over an eigenvector's
    split into the same groups, or the same split of two eigenvectors, is one gate, kept as
    the label gate, else as the split of the eigenvector with the lowest rank."""
    order = gates.assign(_label=gates["source"] != "labels", _rank=pd.to_numeric(gates["eigen_rank"]),
                         _pair=[tuple(sorted(p)) for p in zip(gates["group_a"], gates["group_b"])])
    order = order.sort_values(["_label", "_rank"], kind="stable", na_position="first")
    kept = order.drop_duplicates(["out_feature", "_pair"]).sort_index()
    return kept.drop(columns=["_label", "_rank", "_pair"]).reset_index(drop=True)


def _no_sets() -> pd.DataFrame:
    return pd.DataFrame(columns=["out_feature", "eigen_rank", "members"])


def _read_set_stats(mlp: MLPWeights, basis, directions, sets: pd.DataFrame, width: int, n_in: int) -> ReadSetStats:
    device = basis.device
    members = torch.full((len(sets), width), -1, dtype=torch.long, device=device)
    for row, m in enumerate(sets["members"]):
        members[row, : len(m)] = torch.tensor(m, device=device)
    outputs = torch.tensor(sets["out_feature"].tolist(), dtype=torch.long, device=device)
    i, j = pair_slots(width)
    valid = (members[:, i] >= 0) & (members[:, j] >= 0)
    out = outputs[:, None].expand_as(valid)
    safe = members.clamp_min(0)
    cross = 2 * pair_coefficients(mlp.W_gate, mlp.W_in, mlp.W_out, basis, directions, out.reshape(-1),
                                  safe[:, i].reshape(-1), safe[:, j].reshape(-1)).view(valid.shape)
    return ReadSetStats(outputs, members, torch.where(valid, cross, torch.zeros_like(cross)), n_in)


def _eigen_frame(stats: ReadSetStats, sets: pd.DataFrame, basis, facts: InputFacts, cfg: VerdictConfig) -> pd.DataFrame:
    """The best split of each reading set, with the share of its cross terms that split
    member pairs carry."""
    masks_a, masks_b, result = stats.best_splits()
    width = stats.M
    i, j = pair_slots(width)
    single, both, total = stats.coactive()
    contributions = stats.contribution  # [S, P]: computed once, not once per set
    lift = both * total[:, None] / (single[:, i] * single[:, j])
    units = basis[:, :-1] / basis[:, :-1].norm(dim=0).clamp_min(1e-30)
    sides = [[[m for slot, m in enumerate(members) if mask >> slot & 1] for members, mask in zip(sets["members"], masks)]
             for masks in (masks_a.tolist(), masks_b.tolist())]
    members_a, members_b = sides
    # every set's member pairs that the split cuts, at once: [S, P], their inputs a and b
    slots = torch.arange(width, device=masks_a.device)
    in_a, in_b = ((masks[:, None] >> slots) & 1 == 1 for masks in (masks_a, masks_b))
    across = (in_a[:, i] & in_b[:, j]) | (in_b[:, i] & in_a[:, j])  # the sides hold real members only
    row, p = across.nonzero(as_tuple=True)
    a, b = stats.members[row, i[p]], stats.members[row, j[p]]
    cosine = (units[:, a] * units[:, b]).sum(0).cpu().numpy()
    a, b = a.cpu().numpy(), b.cpu().numpy()
    split = split_evidence(facts.same_top_token(a, b), facts.shared_top_token(a, b), cosine,
                           lift[row, p].cpu().numpy(), cfg.split_lift, cfg.split_cosine)
    contribution = contributions[row, p].cpu().numpy()
    row = row.cpu().numpy()
    total_cross = np.bincount(row, weights=contribution, minlength=len(sets))
    split_cross = np.bincount(row, weights=np.where(split, contribution, 0.0), minlength=len(sets))
    # a set with no cut pair, or whose cut pairs carry nothing, has no share
    shares = np.where(total_cross > 0, split_cross / np.where(total_cross > 0, total_cross, 1.0), np.nan)
    return _gate_frame(result, cfg, source="eigen", out_feature=sets["out_feature"], eigen_rank=sets["eigen_rank"],
                       members_a=members_a, members_b=members_b,
                       label_a=[facts.group_label(m) for m in members_a],
                       label_b=[facts.group_label(m) for m in members_b],
                       split_share=shares, split_pair=np.nan_to_num(shares, nan=0.0) >= 0.5)


def _gate_frame(result: GroupResult, cfg: VerdictConfig, **columns) -> pd.DataFrame:
    scores = result.scores(cfg.min_cell)
    np_ = lambda t: t.detach().cpu().numpy()  # noqa: E731
    counts = np_(result.cell_tokens)
    frame = pd.DataFrame({
        **{k: (list(v) if isinstance(v, (list, pd.Series)) else v) for k, v in columns.items()},
        "n_active": np_(result.n_active).astype(np.int64),
        "coactivation": np_(scores["coactivation"]), "contribution_share": np_(scores["contribution_share"]),
        "and_data": np_(scores["and_data"]), "gate_score": np_(scores["gate_score"]),
        "n_both": counts[:, 0].astype(np.int64), "n_a_only": counts[:, 1].astype(np.int64),
        "n_b_only": counts[:, 2].astype(np.int64),
    })
    means, shares = np_(scores["cell_mean"]), np_(scores["cell_active_share"])
    frame["cells"] = [[(name, int(counts[r, c]), float(means[r, c]), float(shares[r, c])) for c, name in enumerate(CELLS)]
                      for r in range(len(frame))]
    return frame


def _with_group_ids(gates: pd.DataFrame) -> pd.DataFrame:
    """Ids for the layer's distinct groups, in order of first appearance (label groups, then
    the reading sets' sides by output)."""
    ids: dict[tuple[int, ...], int] = {}
    for column in ("members_a", "members_b"):
        gates[column] = [[int(m) for m in members] for members in gates[column]]
    order = gates.sort_values(["source", "out_feature"], key=lambda s: s.map({"labels": 0, "eigen": 1})
                              if s.name == "source" else s, kind="stable")
    for a, b in zip(order["members_a"], order["members_b"]):
        for members in (a, b):
            ids.setdefault(tuple(members), len(ids))
    gates["group_a"] = [ids[tuple(m)] for m in gates["members_a"]]
    gates["group_b"] = [ids[tuple(m)] for m in gates["members_b"]]
    return gates
