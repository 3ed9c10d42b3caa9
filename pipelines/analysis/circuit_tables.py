"""One layer's circuit tables, end to end: weights and activations in, tables out, from the
tensor steps of `circuits.layer`, with progress bars, timings and worker threads.

Tables (columns and types in `pipelines.schemas`):
- `interactions`: per output, the top terms of each kind (`self`, `cross`, `linear`,
  `constant`) of its quadratic form in the input SAE's latents, by |coefficient|;
- `gates`: per output, candidate AND-gate pairs with the weight-only score and, for outputs
  that are SAE features and given tokens, what each pair contributes on data
  (`circuits.gates.pairs`), ranked as `circuits.gates.ranking` says;
- `gate_truth`: truth tables of each output's `n_truth` best data-ranked candidates (by
  default every candidate with a `gate_score`: the verdicts stage may pick any of them);
- `eigen`: per output, the largest eigenvalues of its interaction matrix, each with its
  share of the spectrum's energy and, on active tokens, of the output's activation;
- `eigen_inputs`: for each top eigenvector, the input features whose MLP-input directions
  it reads most (|cosine|, with sign; each eigenvector oriented so that its first input's
  cosine is positive);
- `lowrank`: per output feature and rank r, the active-only correlation of the rank-r
  approximation with its real activation;
- `lowrank_samples`: per output feature, a seeded random sample of its active tokens with
  the activation and the rank-r approximations there (for scatter plots);
- `hosvd`: singular values, when the outputs are HOSVD directions.

Outputs are any directions in mlp_out (`Outputs`): the output SAE's encoder rows (the
default) or decoder rows, token unembedding directions, HOSVD directions, or vectors from a
file. Only SAE features have activations, so only they get `lowrank`, `lowrank_samples`,
data gate statistics and truth tables. Coefficients are those of `z'^T Qt z'` (see `circuits.sae_basis`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager, nullcontext

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from circuits.bilinear import interaction_matrices
from circuits.gates.pairs import CELLS, GateStats, coactive_pairs, merge_candidates, pair_terms
from circuits.gates.ranking import and_score, gate_table_ranks
from circuits.interactions import interaction_kinds, interactions_and_gates
from circuits.layer import (CircuitConfig, LayerBatch, Outputs, Prepared, TokenResult, TokenStatistics, eigen_reads,
                            encoder_offset, prepare)
from circuits.sites import DEFAULT_INPUT_SITE
from circuits.spectra import eigh_by_magnitude, group_positions, rebatch
from circuits.weights import MLPWeights, SAEWeights
from pipelines.runtime import intra_op_threads, one_thread_workers


def analyse_layer(
    mlp: MLPWeights,
    sae_in: SAEWeights,
    outputs: Outputs,
    batches: Callable[[], Iterable[LayerBatch]] | None,
    cfg: CircuitConfig,
    *,
    layer: int,
    input_site: str = DEFAULT_INPUT_SITE,
    timings: dict[str, float] | None = None,
    progress: bool = False,
    workers: int = 1,
    token_threads: int | None = None,
) -> dict[str, pd.DataFrame]:
    """All circuit tables of one layer (see the module docstring).

    `sae_in` is the input SAE, on `input_site` (`resid_mid` before the norm, or `mlp_in`
    after it). `batches()` returns an iterable of `LayerBatch`es; it is read once when the
    outputs are SAE features (the gate statistics reread the latents from a sparse copy,
    a few k values per token) and not at all otherwise. `timings`, if given,
    accumulates seconds per stage. Everything runs on the device of `mlp.W_gate`.

    On CPU, `workers` threads analyse chunks of outputs at once, each with one intra-op
    thread: their many small products run fastest on one thread, as splitting each
    operation costs more in synchronisation than it gains. The token passes run with
    `token_threads` intra-op threads (None: as the caller set them, the stage's `--threads`,
    which counts only idle cores): their model passes gain from a second core, and the
    tables are the same.
    """
    timings = {} if timings is None else timings
    at = prepare(mlp, sae_in, outputs, cfg.torch_dtype, input_site)
    device = at.basis.device
    n_in = at.basis.shape[1] - 1
    n_out = at.directions.shape[0]
    lock = threading.Lock()

    def analyse_chunk(f0: int) -> tuple:
        with _timed(timings, "interaction_matrices", lock):
            Q = interaction_matrices(at.mlp.W_gate, at.mlp.W_in, at.mlp.W_out, at.directions[f0 : f0 + cfg.chunk_size])
        with _timed(timings, "projection_top", lock):
            inter, gates = interactions_and_gates(Q, at.basis, cfg.top_n, cfg.n_gates, cfg.block_size)
        with _timed(timings, "eigh", lock):
            lam, V = eigh_by_magnitude(Q)
        return inter, gates, eigen_reads(lam, V, at.unit_inputs, cfg.max_rank, cfg.n_eigen_store, cfg.n_eigen_inputs)

    workers = 1 if device.type != "cpu" else workers
    bar = tqdm(total=n_out, desc=f"layer {layer} weights", unit="feature", disable=not progress)
    with _timed(timings, "weights_wall"), bar:
        chunks = _map_chunks(analyse_chunk, range(0, n_out, cfg.chunk_size), workers,
                             lambda f0: bar.update(min(cfg.chunk_size, n_out - f0)))
    inter, weight_gates, eigen = zip(*chunks)
    lam, vec = torch.cat([e.lam for e in eigen]), torch.cat([e.vectors for e in eigen])

    tables = {
        "interactions": _interactions_frame(inter, layer),
        "eigen_inputs": _eigen_inputs_frame(torch.cat([e.reads for e in eigen]),
                                            torch.cat([e.cosines for e in eigen]), layer),
    }
    if outputs.singular_values is not None:
        tables["hosvd"] = pd.DataFrame({"layer": layer, "component": range(n_out),
                                        "singular_value": _np(outputs.singular_values)})
    gate_pairs = _weight_gate_pairs(weight_gates)
    activation_share = None
    data = None
    if outputs.sae is not None and batches is not None:
        threads = token_threads if device.type == "cpu" else None
        with _timed(timings, "correlations"), intra_op_threads(threads):
            first = _token_pass(batches, lam, vec, n_in, cfg, layer, progress)
        tables["lowrank"] = _lowrank_frame(first.n_active, first.corr, layer)
        # encoder rows: the form plus c_f is the pre-activation
        offset = encoder_offset(at.mlp, outputs.sae, device) if outputs.name == "sae" else None
        tables["lowrank_samples"] = _samples_frame(first.samples, offset, layer)
        activation_share = first.activation_share()
        with _timed(timings, "gate_statistics"), intra_op_threads(threads):
            data = _gate_pass(at, gate_pairs, first, cfg, layer, progress)
    tables["eigen"] = _eigen_frame(torch.cat([e.stored for e in eigen]), torch.cat([e.energy for e in eigen]),
                                   activation_share, layer)
    tables["gates"] = _gates_frame(gate_pairs, data, layer, at)
    if data is not None:
        tables["gate_truth"] = _truth_frame(tables["gates"], data, cfg, layer)
    return {name: frame.assign(outputs=outputs.name, input_site=input_site) for name, frame in tables.items()}


# ------------------------------------------------------------------ token passes


def _token_pass(batches, lam, vec, n_in: int, cfg: CircuitConfig, layer: int, progress: bool) -> TokenResult:
    """`circuits.layer.TokenStatistics` over the layer's tokens, gathered in `token_batch`es."""
    stats = TokenStatistics(lam, vec, n_in, cfg.n_samples, seed=cfg.seed * 7919 + layer)
    for batch in rebatch(tqdm(batches(), desc=f"layer {layer} tokens", disable=not progress),
                         cfg.token_batch, lam.dtype, lam.device):
        stats.update(batch)
    return stats.result(cfg.min_active)


def _candidate_terms(at: Prepared, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple:
    """`circuits.gates.pairs.pair_terms` of the candidates `(out, a, b)`."""
    return pair_terms(at.mlp.W_gate, at.mlp.W_in, at.mlp.W_out, at.basis, at.directions, out, a, b)


def _gate_pass(at: Prepared, weight_pairs, first: TokenResult, cfg: CircuitConfig, layer: int, progress: bool) -> dict:
    """Data statistics of each output's candidate pairs: its weight pairs and co-active pairs."""
    candidates = merge_candidates([weight_pairs, coactive_pairs(first.coactive, cfg.n_coactive)])
    n_out, width = candidates.shape
    out = torch.arange(n_out, device=at.basis.device)[:, None].expand(n_out, width).reshape(-1)
    terms = _candidate_terms(at, out, candidates.in_a.reshape(-1), candidates.in_b.reshape(-1))
    cross, self_a, self_b = (t.view(n_out, width) for t in terms)
    stats = GateStats(candidates, cross.double(), first.max, first.min, at.basis.shape[1] - 1, cfg.n_bins)
    for z, scale, acts in tqdm(first.sparse, desc=f"layer {layer} gates", disable=not progress):
        stats.update(z.to_dense(), scale, acts.to_dense())
    return {"candidates": candidates, "cross": cross, "self_a": self_a, "self_b": self_b,
            "stats": stats.result(cfg.truth_quantile, cfg.min_active)}


# ------------------------------------------------------------------ frames


def _weight_gate_pairs(chunks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.cat([c.in_a for c in chunks]), torch.cat([c.in_b for c in chunks]),
            torch.cat([c.valid for c in chunks]))


def _gates_frame(weight_pairs, data, layer: int, at: Prepared) -> pd.DataFrame:
    """Every candidate with its weight coefficients and, when measured, its data statistics."""
    if data is None:
        a, b, valid = weight_pairs
        n_out, width = a.shape
        out = torch.arange(n_out, device=a.device)[:, None].expand(n_out, width)
        out, a, b = out[valid], a[valid], b[valid]
        cross, self_a, self_b = _candidate_terms(at, out, a, b)
        frame = pd.DataFrame({"out_feature": _np(out), "in_a": _np(a), "in_b": _np(b),
                              "cross": _np(cross), "self_a": _np(self_a), "self_b": _np(self_b)})
        for column in ("n_active", "coactivation", "coactivation_lift", "mean_contribution", "contribution_share",
                       "and_data", "gate_score", "n_both", "n_a_only", "n_b_only"):
            frame[column] = np.nan
    else:
        c, stats = data["candidates"], data["stats"]
        sel = c.valid
        n_out, width = c.shape
        out = torch.arange(n_out, device=c.in_a.device)[:, None].expand(n_out, width)
        frame = pd.DataFrame({
            "out_feature": _np(out[sel]), "in_a": _np(c.in_a[sel]), "in_b": _np(c.in_b[sel]),
            "cross": _np(data["cross"][sel]), "self_a": _np(data["self_a"][sel]), "self_b": _np(data["self_b"][sel]),
            **{k: _np(stats[k][sel]) for k in ("n_active", "coactivation", "coactivation_lift", "mean_contribution",
                                                 "contribution_share", "and_data", "gate_score")},
            **{name: _np(stats["cell_tokens"][..., cell][sel]) for cell, name in enumerate(("n_both", "n_a_only", "n_b_only"))},
        })
    frame["and_score"] = and_score(frame["cross"], frame["self_a"], frame["self_b"])
    a, b = (torch.tensor(frame[c].to_numpy(dtype=np.int64), device=at.unit_inputs.device) for c in ("in_a", "in_b"))
    frame["input_cosine"] = _np((at.unit_inputs[:, a] * at.unit_inputs[:, b]).sum(0))
    frame["layer"] = layer
    ranks = gate_table_ranks(frame["out_feature"].to_numpy(), frame["and_score"].to_numpy(),
                             frame["gate_score"].to_numpy(dtype=float))
    for name, rank in zip(("weight_rank", "data_rank", "layer_rank"), ranks):
        frame[name] = rank if name == "weight_rank" else pd.arrays.IntegerArray(rank, rank == 0)
    return frame.sort_values(["out_feature", "weight_rank"]).reset_index(drop=True)


def _truth_frame(gates: pd.DataFrame, data: dict, cfg: CircuitConfig, layer: int) -> pd.DataFrame:
    """The truth tables of each output's `n_truth` best data-ranked candidates, a row per cell."""
    chosen = gates[gates["data_rank"] <= cfg.n_truth]
    c, stats = data["candidates"], data["stats"]
    f = torch.tensor(chosen["out_feature"].to_numpy(dtype=np.int64))
    a = torch.tensor(chosen["in_a"].to_numpy(dtype=np.int64))
    b = torch.tensor(chosen["in_b"].to_numpy(dtype=np.int64))
    # each chosen row's slot among its output's candidates
    match = (c.in_a.cpu()[f] == a[:, None]) & (c.in_b.cpu()[f] == b[:, None]) & c.valid.cpu()[f]
    slot = match.float().argmax(1)
    cell = lambda name: stats[name].cpu()[f, slot]  # noqa: E731  [n, 4]
    n = len(chosen)
    repeat = lambda values: np.repeat(np.asarray(values), len(CELLS))  # noqa: E731
    return pd.DataFrame({
        "layer": layer, "out_feature": repeat(f.numpy()), "in_a": repeat(a.numpy()), "in_b": repeat(b.numpy()),
        "layer_rank": pd.array(repeat(chosen["layer_rank"].to_numpy(dtype=object)), dtype="Int64"),
        "cell": np.tile(np.array(CELLS, dtype=object), n),
        "n_tokens": _np(cell("cell_tokens")).reshape(-1).astype(np.int64),
        "mean_activation": _np(cell("cell_mean")).reshape(-1),
        "active_share": _np(cell("cell_active_share")).reshape(-1),
        "quantile_activation": _np(cell("cell_quantile")).reshape(-1),
    })


@contextmanager
def _timed(timings: dict[str, float], stage: str, lock: threading.Lock | None = None):
    """Add the seconds spent in the block to `timings[stage]` (summed over worker threads)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        with lock or nullcontext():
            timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - start


def _map_chunks(fn, starts, workers: int, done) -> list:
    """`[fn(s) for s in starts]`, on `workers` threads with one intra-op thread each.

    The per-chunk work mixes large products with many small ones (eigh of d x d matrices,
    top-k, gathers); splitting chunks across cores beats splitting each operation, whose
    thread synchronisation dominates at these sizes and collapses on a busy machine.
    """
    if workers == 1:
        results = []
        for s in starts:
            results.append(fn(s))
            done(s)
        return results
    with one_thread_workers(workers) as pool:
        futures = [pool.submit(fn, s) for s in starts]
        for s, future in zip(starts, futures):
            future.result()
            done(s)
        return [future.result() for future in futures]


def _np(t: torch.Tensor):
    return t.detach().cpu().double().numpy() if t.is_floating_point() else t.detach().cpu().numpy()


def _rows(n_features: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature index and 1-based rank of each cell of an `[n_features, width]` table."""
    feature = torch.arange(n_features).unsqueeze(1).expand(n_features, width)
    rank = torch.arange(1, width + 1).unsqueeze(0).expand(n_features, width)
    return feature, rank


def _interactions_frame(chunks, layer: int) -> pd.DataFrame:
    in_a = torch.cat([c.in_a for c in chunks]).cpu()
    in_b = torch.cat([c.in_b for c in chunks]).cpu()
    coefficient = torch.cat([c.coefficient for c in chunks]).cpu()
    rank = torch.cat([c.rank for c in chunks]).cpu()
    valid = torch.cat([c.valid for c in chunks]).cpu()
    feature, _ = _rows(*in_a.shape)
    return pd.DataFrame(
        {
            "layer": layer,
            "out_feature": _np(feature[valid]),
            "rank": _np(rank[valid]),
            "in_a": _np(in_a[valid]),
            "in_b": _np(in_b[valid]),
            "kind": interaction_kinds(in_a[valid], in_b[valid]),
            "coefficient": _np(coefficient[valid]),
        }
    )


def _eigen_frame(lam: torch.Tensor, energy: torch.Tensor, activation_share: torch.Tensor | None,
                 layer: int) -> pd.DataFrame:
    feature, rank = _rows(*lam.shape)
    share = torch.full(lam.shape, float("nan"), dtype=torch.float64)
    if activation_share is not None:
        R = min(activation_share.shape[1], lam.shape[1])
        share[:, :R] = activation_share[:, :R].cpu()
    return pd.DataFrame(
        {
            "layer": layer,
            "out_feature": _np(feature.reshape(-1)),
            "rank": _np(rank.reshape(-1)),
            "eigenvalue": _np(lam.reshape(-1)),
            "energy_share": _np(energy.reshape(-1)),
            "activation_share": _np(share.reshape(-1)),
        }
    )


def _eigen_inputs_frame(reads: torch.Tensor, cosines: torch.Tensor, layer: int) -> pd.DataFrame:
    """`reads, cosines [n_out, R, m]` -> one row per (output, eigenvector, input)."""
    n_out, R, m = reads.shape
    out = torch.arange(n_out)[:, None, None].expand(n_out, R, m)
    rank = torch.arange(1, R + 1)[None, :, None].expand(n_out, R, m)
    position = torch.arange(1, m + 1)[None, None, :].expand(n_out, R, m)
    return pd.DataFrame({
        "layer": layer, "out_feature": _np(out.reshape(-1)), "eigen_rank": _np(rank.reshape(-1)),
        "input_rank": _np(position.reshape(-1)), "in_feature": _np(reads.reshape(-1)),
        "cosine": _np(cosines.reshape(-1)),
    })


def _samples_frame(samples: tuple, offset: torch.Tensor | None, layer: int) -> pd.DataFrame:
    """Long form of the sampled tokens: one row per (feature, sample, rank)."""
    feature, _, act, approx = samples  # ordered by feature, then key
    R = approx.shape[1]
    sample = group_positions(feature) + 1
    offsets = offset[feature] if offset is not None else torch.full_like(act, float("nan"))
    repeat = lambda t: _np(t.unsqueeze(1).expand(len(t), R).reshape(-1))  # noqa: E731
    return pd.DataFrame({
        "layer": layer, "out_feature": repeat(feature), "sample": repeat(sample),
        "n_eigs": np.tile(np.arange(1, R + 1), len(feature)), "activation": repeat(act.double()),
        "approx": _np(approx.double().reshape(-1)), "offset": repeat(offsets.double()),
    })


def _lowrank_frame(n_active: torch.Tensor, corr: torch.Tensor, layer: int) -> pd.DataFrame:
    feature, n_eigs = _rows(*corr.shape)
    return pd.DataFrame(
        {
            "layer": layer,
            "out_feature": _np(feature.reshape(-1)),
            "n_eigs": _np(n_eigs.reshape(-1)),
            "n_active": _np(n_active.cpu().unsqueeze(1).expand_as(corr).reshape(-1)),
            "corr_active": _np(corr.reshape(-1)),
        }
    )
