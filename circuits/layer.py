"""One layer's circuit math: its settings, its output directions and the tensor steps that
`pipelines.analysis.circuit_tables` runs and turns into the layer's tables.

The steps, per chunk of outputs and then per batch of tokens:
- `prepare`: the layer's weights, input basis and output directions in the analysis dtype;
- `interaction_matrices` (`circuits.bilinear`), `interactions_and_gates`
  (`circuits.interactions`) and `eigh_by_magnitude` (`circuits.spectra`) on a chunk, then
  `eigen_reads`: the input features each top eigenvector reads;
- `TokenStatistics`: on the tokens, the low-rank correlations, each eigen-term's share of the
  activation, co-activation counts, the activation range and a seeded sample of tokens;
- the gate statistics of `circuits.gates.pairs` on the candidates, ranked by
  `circuits.gates.ranking`.

Outputs are any directions in mlp_out (`Outputs`): the output SAE's encoder rows (the
default) or decoder rows, token unembedding directions, HOSVD directions, or vectors from a
file. Only SAE features have activations, so only they get token statistics. Coefficients
are those of `z'^T Qt z'` (see `circuits.sae_basis`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from circuits.bilinear import hosvd, output_constant
from circuits.config import Config, option, seed_option
from circuits.sae_basis import input_basis, preactivation_offset
from circuits.sites import check_input_site, input_gain
from circuits.spectra import ActiveCorrelation, lowrank_at, smallest_per_group
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
        """`dtype` as the torch dtype the analysis computes in."""
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


def select_outputs(outputs: Outputs, features: torch.Tensor) -> Outputs:
    """The outputs `features [m]` (long) of `outputs` alone, an output SAE's latents sliced
    with them: every per-output result is the same as in the whole set, so a few features are
    read without the whole layer. Activations of the sliced SAE must still be encoded by the
    whole one (its TopK compares every latent): take the columns `features` of those."""
    sae = outputs.sae
    if sae is not None:
        sae = SAEWeights(sae.W_enc[:, features], sae.b_enc[features], sae.W_dec[features], sae.b_dec,
                         sae.apply_b_dec_to_input, sae.k, sae.relu)
    singular = None if outputs.singular_values is None else outputs.singular_values[features]
    return Outputs(outputs.name, outputs.directions[features], sae, singular)


def hosvd_outputs(mlp: MLPWeights, n: int) -> Outputs:
    """The top `n` HOSVD directions of the layer as outputs (for layers without output SAE)."""
    singular, left = hosvd(mlp.W_gate, mlp.W_in, mlp.W_out, n)
    return Outputs("hosvd", left.T.contiguous(), singular_values=singular)


@dataclass
class Prepared:
    """A layer's tensors in the analysis dtype, on the device of its weights."""

    mlp: MLPWeights
    basis: torch.Tensor  # [d_model, n_in + 1], `circuits.sae_basis.input_basis`
    directions: torch.Tensor  # [n_out, d_model]
    unit_inputs: torch.Tensor  # [d_model, n_in], the input features' MLP-input directions, unit length


def prepare(mlp: MLPWeights, sae_in: SAEWeights, outputs: Outputs, dtype: torch.dtype, input_site: str) -> Prepared:
    """Check the shapes and the input site, and bring everything to `dtype` on the device of
    `mlp.W_gate`. `sae_in` is the input SAE, on `input_site` (`resid_mid` before the norm, or
    `mlp_in` after it)."""
    check_input_site(input_site)
    check_shapes(mlp, sae_in, outputs)
    device = mlp.W_gate.device
    mlp = mlp.to(dtype, device)
    sae_in = sae_in.to(dtype, device)
    basis = input_basis(sae_in.W_dec, sae_in.b_dec, input_gain(input_site, mlp.g))
    n_in = basis.shape[1] - 1
    unit_inputs = basis[:, :n_in] / basis[:, :n_in].norm(dim=0).clamp_min(1e-30)
    return Prepared(mlp, basis, outputs.directions.to(device=device, dtype=dtype), unit_inputs)


@dataclass
class EigenReads:
    """A chunk's kept spectrum and what its top eigenvectors read."""

    stored: torch.Tensor  # [c, n_store], the largest eigenvalues by magnitude
    energy: torch.Tensor  # [c, n_store], each one's share of sum(lambda^2)
    lam: torch.Tensor  # [c, R], the top R eigenvalues
    vectors: torch.Tensor  # [c, d_model, R], their eigenvectors
    reads: torch.Tensor  # [c, R, m], long: the inputs each eigenvector reads most, by |cosine|
    cosines: torch.Tensor  # [c, R, m], their cosines, oriented (see `eigen_reads`)


def eigen_reads(lam: torch.Tensor, V: torch.Tensor, unit_inputs: torch.Tensor, max_rank: int, n_store: int,
                n_inputs: int) -> EigenReads:
    """`lam [c, d]`, `V [c, d, d]` from `eigh_by_magnitude`, `unit_inputs [d, n_in]`: the
    `n_store` largest eigenvalues with their energy share, and for the top `max_rank`
    eigenvectors the `n_inputs` input features whose directions they read most."""
    R = min(max_rank, V.shape[-1])
    n_in = unit_inputs.shape[1]
    energy = lam.square() / lam.square().sum(-1, keepdim=True).clamp_min(1e-30)
    top_V = V[:, :, :R].clone()  # clone: the full V [c, d, d] is freed with this chunk
    cos = top_V.transpose(1, 2) @ unit_inputs  # [c, R, n_in]
    reads = cos.abs().topk(min(n_inputs, n_in), dim=-1).indices
    read_cos = cos.gather(-1, reads)
    # an eigenvector's sign is arbitrary (it differs between dtypes and LAPACK builds):
    # orient each so that the input it reads most has a positive cosine
    read_cos = read_cos * torch.where(read_cos[..., :1] < 0, -1.0, 1.0).to(read_cos.dtype)
    return EigenReads(lam[:, :n_store].clone(), energy[:, :n_store].clone(), lam[:, :R].clone(), top_V, reads, read_cos)


@dataclass
class TokenResult:
    """What `TokenStatistics` gathered over a layer's tokens."""

    n_active: torch.Tensor  # [n_out], active tokens per output
    corr: torch.Tensor  # [n_out, R], correlation of the rank-r approximation with the activation, active only
    eigen_activation: torch.Tensor  # [n_out, R], float64 sum over active tokens of each eigen-term
    act_sum: torch.Tensor  # [n_out], float64 sum of the activation
    coactive: torch.Tensor  # [n_out, n_in], float64 tokens on which output and input are both active
    max: torch.Tensor  # [n_out], float64 largest activation (0 for an output never active)
    min: torch.Tensor  # [n_out], float64 smallest activation (0 for an output never active)
    sparse: list  # per batch (z, scale, acts): sparse CSR latents [t, n_in], [t], CSR [t, n_out]
    samples: tuple  # (feature [s], key [s], activation [s], approx [s, R]), ordered by feature, then key

    def activation_share(self) -> torch.Tensor:
        """`[n_out, R]`: each eigen-term's share of the output's summed activation (NaN when it is 0)."""
        total = self.act_sum[:, None]
        return self.eigen_activation / total.where(total != 0, torch.tensor(float("nan"), dtype=torch.float64))


class TokenStatistics:
    """The token pass of one layer's SAE outputs: low-rank correlations, eigen-term sums,
    co-activation counts, the activation range and a seeded random sample of `n_samples`
    active tokens per output. `lam [n_out, R]`, `vec [n_out, d_model, R]` from `eigen_reads`.

    The gate statistics read the same tokens' latents again: kept here as sparse copies (a
    few k values per token), they spare them a second model pass.
    """

    def __init__(self, lam: torch.Tensor, vec: torch.Tensor, n_in: int, n_samples: int, seed: int):
        n_out, R = lam.shape
        device = lam.device
        self.lam, self.vec, self.n_samples = lam, vec, n_samples
        self.stats = ActiveCorrelation(n_out, R, device)
        f64 = dict(dtype=torch.float64, device=device)
        self.eigen_activation = torch.zeros(n_out, R, **f64)
        self.act_sum = torch.zeros(n_out, **f64)
        self.coactive = torch.zeros(n_out, n_in, **f64)
        self.high = torch.full((n_out,), float("-inf"), **f64)
        self.low = torch.full((n_out,), float("inf"), **f64)
        self.sparse = []
        self.keys = torch.Generator().manual_seed(seed)  # the sample's random keys, in token order
        samples = tuple(torch.empty(0, dtype=t, device=device) for t in (torch.long, torch.float64, lam.dtype))
        self.samples = samples + (torch.empty(0, R, dtype=lam.dtype, device=device),)

    def update(self, batch: LayerBatch) -> None:
        """Add a batch of tokens (in the dtype and on the device of `lam`)."""
        token, feature = batch.acts.nonzero(as_tuple=True)
        on_in = csr(batch.z, *batch.z.nonzero(as_tuple=True))
        self.sparse.append((on_in, batch.scale, csr(batch.acts, token, feature)))
        if token.numel() == 0:
            return
        approx = lowrank_at(batch.x, self.lam, self.vec, token, feature)  # [p, R], cumulative
        act = batch.acts[token, feature]
        self.stats.update(approx, act, feature)
        if self.n_samples:
            key = torch.rand(len(feature), generator=self.keys, dtype=torch.float64).to(act.device)
            pool = [torch.cat(pair) for pair in zip(self.samples, (feature, key, act, approx))]
            self.samples = tuple(t[smallest_per_group(pool[0], pool[1], self.n_samples)] for t in pool)
        terms = torch.diff(approx, dim=1, prepend=torch.zeros_like(approx[:, :1]))
        self.eigen_activation.index_add_(0, feature, terms.double())
        self.act_sum.index_add_(0, feature, act.double())
        # [n_out, t] sparse times [t, n_in]: k_out * n_in products per token instead of n_out * n_in
        on_out = csr(batch.acts, token, feature, torch.ones_like(act)).t()
        self.coactive += (on_out @ (batch.z != 0).to(act.dtype)).double()
        self.high.scatter_reduce_(0, feature, act.double(), "amax")
        self.low.scatter_reduce_(0, feature, act.double(), "amin")

    def result(self, min_active: int) -> TokenResult:
        """The statistics; correlations of outputs with fewer than `min_active` active tokens are NaN."""
        n_active, corr = self.stats.result(min_active)
        finite = torch.isfinite(self.high)
        return TokenResult(n_active, corr, self.eigen_activation, self.act_sum, self.coactive,
                           torch.where(finite, self.high, 0.0), torch.where(finite, self.low, 0.0),
                           self.sparse, self.samples)


def csr(dense: torch.Tensor, row: torch.Tensor, col: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    """`dense [t, n]` as a sparse CSR tensor from its nonzero positions `row, col [p]`
    (row-major, as `nonzero` gives them); `values [p]` replaces the entries when given."""
    counts = torch.bincount(row, minlength=dense.shape[0])
    crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    with warnings.catch_warnings():
        # torch warns on every construction that CSR support is in beta and that it skips invariant
        # checks: the indices here come from `nonzero`, valid by construction, and the products
        # used (transpose, times a dense matrix) are tested against the dense ones
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state", category=UserWarning)
        warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled", category=UserWarning)
        return torch.sparse_csr_tensor(crow, col, dense[row, col] if values is None else values, dense.shape)


def encoder_offset(mlp: MLPWeights, sae_out: SAEWeights, device: torch.device) -> torch.Tensor:
    """`[n_out]` float64: the constant c_f that makes an encoder row's form the output SAE's
    pre-activation (`circuits.sae_basis.preactivation_offset`)."""
    f64 = lambda t: t.to(device, torch.float64)  # noqa: E731
    return preactivation_offset(f64(sae_out.W_enc), f64(sae_out.b_enc), f64(sae_out.b_dec),
                                sae_out.apply_b_dec_to_input,
                                output_constant(f64(mlp.W_out), f64(mlp.b_in), f64(mlp.b_out)))


def check_shapes(mlp: MLPWeights, sae_in: SAEWeights, outputs: Outputs) -> None:
    """Refuse weights, SAEs and output directions of mismatched shapes, naming the culprit."""
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
