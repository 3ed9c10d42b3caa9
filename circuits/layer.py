"""One layer's circuit analysis, end to end: weights and activations in, tables out.

Tables (see `circuits.tables` for columns and types):
- `interactions`: per output feature, the top terms of each kind (`self`, `cross`,
  `linear`, `constant`) of its quadratic form in the input SAE's latents, by |coefficient|;
- `gates`: per output feature, the input pairs with the best AND-gate score;
- `eigen`: per output feature, the largest eigenvalues (by magnitude) of its interaction
  matrix in the model basis;
- `lowrank`: per output feature and rank r, the active-only correlation of the rank-r
  approximation with the feature's real activation;
- `hosvd` (only without an output SAE): singular values of the bilinear tensor; its left
  singular vectors then stand in for output features.

Coefficients are those of `z'^T Qt z'`, which equals the MLP's contribution times
`rms(r)^2` (a positive per-token factor) and is exact up to the input SAE's reconstruction
error; see `circuits.sae_basis`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from circuits.bilinear import hosvd, interaction_matrices
from circuits.interactions import interaction_kinds, interactions_and_gates
from circuits.sae_basis import input_basis, output_directions
from circuits.spectra import active_correlations, eigh_by_magnitude
from circuits.tables import SCHEMAS, write_table
from circuits.weights import MLPWeights, SAEWeights


@dataclass
class CircuitConfig:
    """Settings of the per-layer analysis.

    Memory is bounded by about `n_workers * chunk_size * d_model * (d_mlp + 4 * d_model
    + n_in)` numbers for the weight analysis and `token_batch * (d_model + n_out)` for the
    correlations, plus the kept eigenvectors, `n_out * d_model * max_rank`.
    """

    top_n: int = 50  # interactions kept per output feature and kind, by |coefficient|
    n_gates: int = 20  # AND-gate pairs kept per output feature, by and_score
    max_rank: int = 8  # low-rank approximations r = 1..max_rank are correlated
    n_eigen_store: int = 32  # eigenvalues stored per output feature, by |eigenvalue|
    chunk_size: int = 32  # output features whose interaction matrices are held at once
    block_size: int = 256  # input features per side of each block of the projected matrix
    token_batch: int = 8192  # tokens gathered before each correlation update
    min_active: int = 20  # fewer active tokens than this give corr_active NaN
    n_hosvd: int = 64  # HOSVD components analysed when there is no output SAE
    n_workers: int = 0  # threads analysing chunks in parallel on CPU; 0 = torch.get_num_threads()
    dtype: str = "float32"  # torch dtype of all tensor math (statistics use float64)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name == "n_workers" else 1
            if f.name != "dtype" and (not isinstance(value, int) or value < least):
                raise ValueError(f"CircuitConfig.{f.name} must be an int >= {least}, got {value!r}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"CircuitConfig.dtype {self.dtype!r} is not a torch dtype")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CircuitConfig":
        data = json.loads(text)
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown CircuitConfig fields: {sorted(unknown)}")
        return cls(**data)


def analyse_layer(
    mlp: MLPWeights,
    sae_in: SAEWeights,
    sae_out: SAEWeights | None,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]] | None,
    cfg: CircuitConfig,
    layer: int,
    timings: dict[str, float] | None = None,
    progress: bool = False,
) -> dict[str, pd.DataFrame]:
    """All circuit tables of one layer.

    `sae_in` is the SAE on resid_mid (the MLP's input side, before the norm); `sae_out` the
    SAE on mlp_out, or None to analyse the top `cfg.n_hosvd` HOSVD directions instead (then
    there is no `lowrank` table). `batches` yields `(x [..., d_model], acts [..., n_out])`:
    the real MLP input `x = ln2.hook_normalized * ln2.w` and the output SAE's activations of
    the same tokens; it is read once, after the weight analysis. `timings`, if given,
    accumulates seconds per stage: `interaction_matrices`, `projection_top` and `eigh`
    (summed over worker threads), `weights_wall`, `correlations` and `hosvd`. Everything
    runs on the device of `mlp.W_gate`.
    """
    timings = {} if timings is None else timings
    _check_shapes(mlp, sae_in, sae_out)
    device = mlp.W_gate.device
    mlp = mlp.to(cfg.torch_dtype, device)
    sae_in = sae_in.to(cfg.torch_dtype, device)
    basis = input_basis(sae_in.W_dec, sae_in.b_dec, mlp.g)
    tables: dict[str, pd.DataFrame] = {}
    if sae_out is None:
        with _timed(timings, "hosvd"):
            singular, left = hosvd(mlp.W_gate, mlp.W_in, mlp.W_out, cfg.n_hosvd)
        directions = left.T
        tables["hosvd"] = pd.DataFrame(
            {"layer": layer, "component": range(len(singular)), "singular_value": _np(singular)}
        )
    else:
        directions = output_directions(sae_out.to(cfg.torch_dtype, device).W_enc)

    n_out = directions.shape[0]
    R = min(cfg.max_rank, basis.shape[0])
    lock = threading.Lock()

    def analyse_chunk(f0: int) -> tuple:
        with _timed(timings, "interaction_matrices", lock):
            U = directions[f0 : f0 + cfg.chunk_size]
            Q = interaction_matrices(mlp.W_gate, mlp.W_in, mlp.W_out, U)
        with _timed(timings, "projection_top", lock):
            inter, gates = interactions_and_gates(Q, basis, cfg.top_n, cfg.n_gates, cfg.block_size)
        with _timed(timings, "eigh", lock):
            lam, V = eigh_by_magnitude(Q)
        # clone so that the full V [c, d, d] is freed with this chunk
        stored = lam[:, : cfg.n_eigen_store].clone()
        return inter, gates, stored, lam[:, :R].clone(), V[:, :, :R].clone()

    workers = 1 if device.type != "cpu" else cfg.n_workers or torch.get_num_threads()
    bar = tqdm(total=n_out, desc=f"layer {layer} weights", unit="feature", disable=not progress)
    with _timed(timings, "weights_wall"), bar:
        chunks = _map_chunks(analyse_chunk, range(0, n_out, cfg.chunk_size), workers,
                             lambda f0: bar.update(min(cfg.chunk_size, n_out - f0)))
    inter, gates, eig, lam, vec = zip(*chunks)

    tables["interactions"] = _interactions_frame(inter, layer)
    tables["gates"] = _gates_frame(gates, layer)
    tables["eigen"] = _eigen_frame(torch.cat(eig), layer)
    if sae_out is not None:
        if batches is None:
            raise ValueError("batches of (x, acts) are needed to correlate output features")
        # one thread: this stage is many small products, where thread synchronisation costs
        # more than it saves (several times over on a busy machine)
        threads = 1 if device.type == "cpu" else None
        with _timed(timings, "correlations"), _intra_op_threads(threads):
            batches = tqdm(batches, desc=f"layer {layer} tokens", disable=not progress)
            n_active, corr = active_correlations(
                batches, torch.cat(lam), torch.cat(vec), cfg.min_active, cfg.token_batch
            )
        tables["lowrank"] = _lowrank_frame(n_active, corr, layer)
    return tables


def write_layer_tables(
    tables: dict[str, pd.DataFrame], root: str | Path, layer: int
) -> dict[str, Path]:
    """Write each table of `analyse_layer` as partition `layer=<layer>` under `root/<name>/`."""
    return {
        name: write_table(df, root, name, layer=layer, schema=SCHEMAS[name])
        for name, df in tables.items()
    }


def _check_shapes(mlp: MLPWeights, sae_in: SAEWeights, sae_out: SAEWeights | None) -> None:
    d_model, d_mlp = mlp.W_gate.shape
    expected = {
        "W_in": (mlp.W_in.shape, (d_model, d_mlp)),
        "W_out": (mlp.W_out.shape, (d_mlp, d_model)),
        "g": (mlp.g.shape, (d_model,)),
        "input SAE W_dec": (sae_in.W_dec.shape[1:], (d_model,)),
    }
    if sae_out is not None:
        expected["output SAE W_enc"] = (sae_out.W_enc.shape[:1], (d_model,))
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
    with _intra_op_threads(1), ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(fn, s) for s in starts]
        for s, future in zip(starts, futures):
            future.result()
            done(s)
        return [future.result() for future in futures]


@contextmanager
def _intra_op_threads(n: int | None):
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


def _gates_frame(chunks, layer: int) -> pd.DataFrame:
    valid = torch.cat([c.valid for c in chunks]).cpu()
    feature, _ = _rows(*valid.shape)
    frame = {"layer": layer, "out_feature": _np(feature[valid])}
    for column in ("in_a", "in_b", "and_score", "self_a", "self_b", "cross"):
        frame[column] = _np(torch.cat([getattr(c, column) for c in chunks]).cpu()[valid])
    return pd.DataFrame(frame)


def _eigen_frame(lam: torch.Tensor, layer: int) -> pd.DataFrame:
    feature, rank = _rows(*lam.shape)
    return pd.DataFrame(
        {
            "layer": layer,
            "out_feature": _np(feature.reshape(-1)),
            "rank": _np(rank.reshape(-1)),
            "eigenvalue": _np(lam.reshape(-1)),
        }
    )


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
