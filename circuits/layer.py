"""One layer's circuit analysis, end to end: weights and activations in, tables out.

Tables (columns and types in `pipelines.schemas`, where they are written):
- `interactions`: per output, the top terms of each kind (`self`, `cross`, `linear`,
  `constant`) of its quadratic form in the input SAE's latents, by |coefficient|;
- `gates`: per output, candidate AND-gate pairs with the weight-only score and, for outputs
  that are SAE features and given tokens, what each pair contributes on data
  (`circuits.gates.pairs`), ranked per layer by that contribution;
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
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from circuits.bilinear import hosvd, interaction_matrices, output_constant
from circuits.config import Config, option, seed_option
from circuits.gates.pairs import CELLS, GateStats, coactive_pairs, merge_candidates, pair_coefficients
from circuits.interactions import interaction_kinds, interactions_and_gates
from circuits.sae_basis import input_basis, preactivation_offset
from circuits.sites import DEFAULT_INPUT_SITE, check_input_site, input_gain
from circuits.spectra import (ActiveCorrelation, eigh_by_magnitude, group_positions, lowrank_at, rebatch,
                              smallest_per_group)
from circuits.weights import MLPWeights, SAEWeights


@dataclass(frozen=True)
class CircuitConfig(Config):
    """Settings of the per-layer analysis.

    Memory is bounded by about `workers * chunk_size * d_model * (d_mlp + 4 * d_model
    + n_in)` numbers for the weight analysis and `token_batch * (d_model + n_in + n_out)` for
    the token passes, plus the kept eigenvectors, `n_out * d_model * max_rank`.
    """

    top_n: int = option(50, "interactions kept per output feature and kind (self, cross, linear), by |coefficient|", low=1)
    n_gates: int = option(20, "weight-ranked AND-gate pairs kept per output feature", low=1)
    n_coactive: int = option(8, "inputs most often active with an output whose pairs also become gate candidates", low=2)
    n_truth: int = option(64, "best data-ranked gate candidates per output with a truth table", low=0)
    truth_quantile: float = option(0.9, "upper quantile of the output's activation shown per truth-table cell", low=0.0, high=1.0)
    n_bins: int = option(64, "histogram bins per truth-table cell (the quantile's resolution)", low=2)
    max_rank: int = option(8, "largest rank r of the low-rank approximations that are correlated", low=1)
    n_samples: int = option(64, "active tokens per output feature (a seeded random sample) whose activation and "
                                "low-rank approximations are stored, for scatter plots", low=0)
    n_eigen_store: int = option(32, "eigenvalues stored per output feature, by |eigenvalue|", low=1)
    n_eigen_inputs: int = option(8, "input features listed per top eigenvector, by |cosine|", low=1)
    min_active: int = option(20, "fewer active tokens than this give NaN correlations and no data gate rank", low=1)
    n_hosvd: int = option(64, "HOSVD components analysed with --outputs hosvd", low=1)
    chunk_size: int = option(32, "output features whose interaction matrices are held at once", low=1, runtime=True)
    block_size: int = option(256, "input features per side of each block of the projected matrix", low=1, runtime=True)
    token_batch: int = option(8192, "tokens gathered before each statistics update", low=1, runtime=True)
    dtype: str = option("float32", "torch dtype of the tensor math (statistics use float64)", choices=("float32", "float64"))
    seed: int = seed_option("seeds the sample of active tokens stored per output feature (lowrank_samples)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass
class Outputs:
    """The output directions of one analysis and what they are."""

    name: str  # "sae" (encoder rows), "sae-decoder", "hosvd", "logit:good-bad", "file:dirs.npy"
    directions: torch.Tensor  # [n_out, d_model]
    sae: SAEWeights | None = None  # the output SAE whose activations define "active", if any
    singular_values: torch.Tensor | None = None  # [n_out], for HOSVD directions


@dataclass
class LayerBatch:
    """Tokens of one layer for the statistics passes."""

    x: torch.Tensor  # [t, d_model], the MLP input (after the norm and its gain)
    z: torch.Tensor  # [t, n_in], input SAE activations
    scale: torch.Tensor  # [t], s with x^T Q x = s z'^T Qt z' (`circuits.sae_basis.token_scale`)
    acts: torch.Tensor  # [t, n_out], output SAE activations


def hosvd_outputs(mlp: MLPWeights, n: int) -> Outputs:
    """The top `n` HOSVD directions of the layer as outputs (for layers without output SAE)."""
    singular, left = hosvd(mlp.W_gate, mlp.W_in, mlp.W_out, n)
    return Outputs("hosvd", left.T.contiguous(), singular_values=singular)


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
    token_threads: int | None = 1,
) -> dict[str, pd.DataFrame]:
    """All circuit tables of one layer (see the module docstring).

    `sae_in` is the input SAE, on `input_site` (`resid_mid` before the norm, or `mlp_in`
    after it). `batches()` returns an iterable of `LayerBatch`es; it is read once when the
    outputs are SAE features (the gate statistics reread the latents from a sparse copy,
    a few k values per token) and not at all otherwise. `timings`, if given,
    accumulates seconds per stage. Everything runs on the device of `mlp.W_gate`.

    On CPU, `workers` threads analyse chunks of outputs at once, each with one intra-op
    thread, and the token passes run with `token_threads` intra-op threads (None: as the
    caller set them). Their many small products run fastest on one thread: splitting each
    operation costs more in synchronisation than it gains, and collapses on a busy machine.
    """
    check_input_site(input_site)
    timings = {} if timings is None else timings
    _check_shapes(mlp, sae_in, outputs)
    device = mlp.W_gate.device
    dtype = cfg.torch_dtype
    mlp = mlp.to(dtype, device)
    sae_in = sae_in.to(dtype, device)
    directions = outputs.directions.to(device=device, dtype=dtype)
    basis = input_basis(sae_in.W_dec, sae_in.b_dec, input_gain(input_site, mlp.g))
    n_in = basis.shape[1] - 1
    unit_inputs = basis[:, :n_in] / basis[:, :n_in].norm(dim=0).clamp_min(1e-30)
    n_out, d = directions.shape
    R = min(cfg.max_rank, d)
    lock = threading.Lock()

    def analyse_chunk(f0: int) -> tuple:
        with _timed(timings, "interaction_matrices", lock):
            Q = interaction_matrices(mlp.W_gate, mlp.W_in, mlp.W_out, directions[f0 : f0 + cfg.chunk_size])
        with _timed(timings, "projection_top", lock):
            inter, gates = interactions_and_gates(Q, basis, cfg.top_n, cfg.n_gates, cfg.block_size)
        with _timed(timings, "eigh", lock):
            lam, V = eigh_by_magnitude(Q)
        energy = lam.square() / lam.square().sum(-1, keepdim=True).clamp_min(1e-30)
        top_V = V[:, :, :R].clone()  # clone: the full V [c, d, d] is freed with this chunk
        cos = top_V.transpose(1, 2) @ unit_inputs  # [c, R, n_in]
        reads = cos.abs().topk(min(cfg.n_eigen_inputs, n_in), dim=-1).indices
        read_cos = cos.gather(-1, reads)
        # an eigenvector's sign is arbitrary (it differs between dtypes and LAPACK builds):
        # orient each so that the input it reads most has a positive cosine
        read_cos = read_cos * torch.where(read_cos[..., :1] < 0, -1.0, 1.0).to(read_cos.dtype)
        return (inter, gates, lam[:, : cfg.n_eigen_store].clone(), energy[:, : cfg.n_eigen_store].clone(),
                lam[:, :R].clone(), top_V, reads, read_cos)

    workers = 1 if device.type != "cpu" else workers
    bar = tqdm(total=n_out, desc=f"layer {layer} weights", unit="feature", disable=not progress)
    with _timed(timings, "weights_wall"), bar:
        chunks = _map_chunks(analyse_chunk, range(0, n_out, cfg.chunk_size), workers,
                             lambda f0: bar.update(min(cfg.chunk_size, n_out - f0)))
    inter, weight_gates, stored, energy, lam, vec, reads, cosines = zip(*chunks)
    lam, vec = torch.cat(lam), torch.cat(vec)

    tables = {
        "interactions": _interactions_frame(inter, layer),
        "eigen_inputs": _eigen_inputs_frame(torch.cat(reads), torch.cat(cosines), layer),
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
            first = _first_pass(batches, lam, vec, n_in, cfg, layer, progress)
        tables["lowrank"] = _lowrank_frame(first["n_active"], first["corr"], layer)
        offset = None
        if outputs.name == "sae":  # encoder rows: the form plus c_f is the pre-activation
            f64 = lambda t: t.to(device, torch.float64)  # noqa: E731
            sae_out = outputs.sae
            offset = preactivation_offset(f64(sae_out.W_enc), f64(sae_out.b_enc), f64(sae_out.b_dec),
                                          sae_out.apply_b_dec_to_input,
                                          output_constant(f64(mlp.W_out), f64(mlp.b_in), f64(mlp.b_out)))
        tables["lowrank_samples"] = _samples_frame(first["samples"], offset, layer)
        activation_share = first["eigen_activation"] / first["act_sum"][:, None].where(
            first["act_sum"][:, None] != 0, torch.tensor(float("nan"), dtype=torch.float64))
        with _timed(timings, "gate_statistics"), intra_op_threads(threads):
            data = _gate_pass(mlp, basis, directions, gate_pairs, first, cfg, layer, progress)
    tables["eigen"] = _eigen_frame(torch.cat(stored), torch.cat(energy), activation_share, layer)
    tables["gates"] = _gates_frame(gate_pairs, data, cfg, layer, mlp, basis, directions, unit_inputs)
    if data is not None:
        tables["gate_truth"] = _truth_frame(tables["gates"], data, cfg, layer)
    return {name: frame.assign(outputs=outputs.name, input_site=input_site) for name, frame in tables.items()}


# ------------------------------------------------------------------ token passes


def _first_pass(batches, lam, vec, n_in: int, cfg: CircuitConfig, layer: int, progress: bool) -> dict:
    """Correlations, eigen-term activation sums, co-activation counts and activation range."""
    n_out, R = lam.shape
    device = lam.device
    stats = ActiveCorrelation(n_out, R, device)
    eigen_activation = torch.zeros(n_out, R, dtype=torch.float64, device=device)
    act_sum = torch.zeros(n_out, dtype=torch.float64, device=device)
    coactive = torch.zeros(n_out, n_in, dtype=torch.float64, device=device)
    high = torch.full((n_out,), float("-inf"), dtype=torch.float64, device=device)
    low = torch.full((n_out,), float("inf"), dtype=torch.float64, device=device)
    # the gate pass reads the same tokens' sparse latents again: kept here, compressed (a
    # few k per token), they spare it a second model pass
    sparse = []
    keys = torch.Generator().manual_seed(cfg.seed * 7919 + layer)  # the sample's random keys, in token order
    samples = tuple(torch.empty(0, dtype=t, device=device) for t in (torch.long, torch.float64, lam.dtype))
    samples += (torch.empty(0, R, dtype=lam.dtype, device=device),)
    for batch in rebatch(tqdm(batches(), desc=f"layer {layer} tokens", disable=not progress),
                         cfg.token_batch, lam.dtype, device):
        token, feature = batch.acts.nonzero(as_tuple=True)
        on_in = _csr(batch.z, *batch.z.nonzero(as_tuple=True))
        sparse.append((on_in, batch.scale, _csr(batch.acts, token, feature)))
        if token.numel() == 0:
            continue
        approx = lowrank_at(batch.x, lam, vec, token, feature)  # [p, R], cumulative
        act = batch.acts[token, feature]
        stats.update(approx, act, feature)
        if cfg.n_samples:
            key = torch.rand(len(feature), generator=keys, dtype=torch.float64).to(device)
            pool = [torch.cat(pair) for pair in zip(samples, (feature, key, act, approx))]
            samples = tuple(t[smallest_per_group(pool[0], pool[1], cfg.n_samples)] for t in pool)
        terms = torch.diff(approx, dim=1, prepend=torch.zeros_like(approx[:, :1]))
        eigen_activation.index_add_(0, feature, terms.double())
        act_sum.index_add_(0, feature, act.double())
        # [n_out, t] sparse times [t, n_in]: k_out * n_in products per token instead of n_out * n_in
        on_out = _csr(batch.acts, token, feature, torch.ones_like(act)).t()
        coactive += (on_out @ (batch.z != 0).to(act.dtype)).double()
        high.scatter_reduce_(0, feature, act.double(), "amax")
        low.scatter_reduce_(0, feature, act.double(), "amin")
    n_active, corr = stats.result(cfg.min_active)
    finite = torch.isfinite(high)
    return {"n_active": n_active, "corr": corr, "eigen_activation": eigen_activation, "act_sum": act_sum,
            "coactive": coactive, "max": torch.where(finite, high, 0.0), "min": torch.where(finite, low, 0.0),
            "sparse": sparse, "samples": samples}


def _csr(dense: torch.Tensor, row: torch.Tensor, col: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    """`dense [t, n]` as a sparse CSR tensor from its nonzero positions `row, col [p]`
    (row-major, as `nonzero` gives them); `values [p]` replaces the entries when given."""
    counts = torch.bincount(row, minlength=dense.shape[0])
    crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return torch.sparse_csr_tensor(crow, col, dense[row, col] if values is None else values, dense.shape)


def _gate_pass(mlp, basis, directions, weight_pairs, first, cfg, layer, progress) -> dict:
    """Data statistics of each output's candidate pairs: its weight pairs and co-active pairs."""
    candidates = merge_candidates([weight_pairs, coactive_pairs(first["coactive"], cfg.n_coactive)])
    n_out, width = candidates.shape
    out = torch.arange(n_out, device=basis.device)[:, None].expand(n_out, width).reshape(-1)
    a, b = candidates.in_a.reshape(-1), candidates.in_b.reshape(-1)
    coefficient = lambda i, j: pair_coefficients(  # noqa: E731
        mlp.W_gate, mlp.W_in, mlp.W_out, basis, directions, out, i, j).view(n_out, width)
    cross, self_a, self_b = 2 * coefficient(a, b), coefficient(a, a), coefficient(b, b)
    stats = GateStats(candidates, cross.double(), first["max"], first["min"], basis.shape[1] - 1, cfg.n_bins)
    for z, scale, acts in tqdm(first["sparse"], desc=f"layer {layer} gates", disable=not progress):
        stats.update(z.to_dense(), scale, acts.to_dense())
    return {"candidates": candidates, "cross": cross, "self_a": self_a, "self_b": self_b,
            "stats": stats.result(cfg.truth_quantile, cfg.min_active)}


# ------------------------------------------------------------------ frames


def _weight_gate_pairs(chunks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.cat([c.in_a for c in chunks]), torch.cat([c.in_b for c in chunks]),
            torch.cat([c.valid for c in chunks]))


def _gates_frame(weight_pairs, data, cfg: CircuitConfig, layer: int, mlp, basis, directions,
                 unit_inputs) -> pd.DataFrame:
    """Every candidate with its weight coefficients and, when measured, its data statistics."""
    if data is None:
        a, b, valid = weight_pairs
        n_out, width = a.shape
        out = torch.arange(n_out, device=a.device)[:, None].expand(n_out, width)
        sel = valid
        out, a, b = out[sel], a[sel], b[sel]
        coefficient = lambda i, j: pair_coefficients(  # noqa: E731
            mlp.W_gate, mlp.W_in, mlp.W_out, basis, directions, out, i, j)
        cross, self_a, self_b = 2 * coefficient(a, b), coefficient(a, a), coefficient(b, b)
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
    frame["and_score"] = frame["cross"] - frame["self_a"].abs() - frame["self_b"].abs()
    a, b = (torch.tensor(frame[c].to_numpy(dtype=np.int64), device=unit_inputs.device) for c in ("in_a", "in_b"))
    frame["input_cosine"] = _np((unit_inputs[:, a] * unit_inputs[:, b]).sum(0))
    frame["layer"] = layer
    frame["weight_rank"] = frame.groupby("out_feature")["and_score"].rank(ascending=False, method="first").astype("int64")
    frame["data_rank"] = frame["gate_score"].groupby(frame["out_feature"]).rank(
        ascending=False, method="first").astype("Int64")
    best = frame[frame["data_rank"] == 1]
    layer_rank = best["gate_score"].rank(ascending=False, method="first").astype("int64")
    frame["layer_rank"] = pd.Series(layer_rank, dtype="Int64").reindex(frame.index)
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


def _check_shapes(mlp: MLPWeights, sae_in: SAEWeights, outputs: Outputs) -> None:
    d_model, d_mlp = mlp.W_gate.shape
    expected = {
        "W_in": (mlp.W_in.shape, (d_model, d_mlp)),
        "W_out": (mlp.W_out.shape, (d_mlp, d_model)),
        "g": (mlp.g.shape, (d_model,)),
        "input SAE W_dec": (sae_in.W_dec.shape[1:], (d_model,)),
        "output directions": (outputs.directions.shape[1:], (d_model,)),
    }
    if outputs.sae is not None:
        expected["output SAE W_enc"] = (outputs.sae.W_enc.shape[:1], (d_model,))
        expected["output directions"] = (outputs.directions.shape, (outputs.sae.d_sae, d_model))
    for name, (shape, want) in expected.items():
        if tuple(shape) != want:
            raise ValueError(f"{name} has shape {tuple(shape)}, expected {want}")


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
    with intra_op_threads(1), ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(fn, s) for s in starts]
        for s, future in zip(starts, futures):
            future.result()
            done(s)
        return [future.result() for future in futures]


@contextmanager
def intra_op_threads(n: int | None):
    """Run the block with torch's intra-op thread count set to `n` (None: leave it)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
