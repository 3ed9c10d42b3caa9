"""The HTML report of a run: SAE quality, low-rank correlations, AND-gate candidates.

`write_report` reads the run's tables, recomputes what the tables do not hold (interaction
submatrices, approximation-versus-activation scatters) from the model and the SAEs, and
writes `run/report/index.html` with its PNG figures beside it. The page is self-contained:
no scripts, no network, figures by relative path. Tables that a run lacks (no lowrank table
when a layer had no output SAE, no features table yet) leave a note in place of their
section instead of failing the report.
"""

from __future__ import annotations

import functools
import html
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from transformer_lens import HookedTransformer

from circuits.bilinear import hosvd, interaction_matrices
from circuits.sae_basis import input_basis, output_directions
from circuits.spectra import eigh_by_magnitude
from circuits.tables import read_table
from circuits.weights import MLPWeights, from_hooked_transformer, from_sae_lens
from pipelines.model import load_config, load_model
from pipelines.negation import label_gates, top_gates
from pipelines.paths import RunPaths
from pipelines.stages import token_rows
from pipelines.tokenizer import BOS, load_tokenizer
from sae.activations import iter_activations, keep_mask
from sae.io import load_sae

INDEX = "index.html"
METRIC_COLUMNS = ["layer", "site", "d_sae", "k", "nmse", "l0", "dead_fraction", "loss_added"]
GATE_COLUMNS = ["layer", "out_feature", "in_a", "in_b", "and_score", "cross", "self_a", "self_b"]


@dataclass
class ReportConfig:
    """What the report shows and how much it recomputes (defaults: under a minute on the demo)."""

    n_gates: int = 5  # AND-gate candidates shown in detail, the best pair of each output feature
    gates_per_layer: int = 8  # AND-gate candidates of each layer in the overview table
    n_inputs: int = 8  # input features per interaction heatmap
    n_eigen_bars: int = 16  # largest eigenvalues drawn per spectrum
    n_scatter: int = 4  # output features (of the top gate candidates) with scatter plots
    scatter_ranks: tuple[int, ...] = (1, 2)  # ranks plotted beside the full-rank approximation
    scatter_rows: int = 256  # corpus rows run through the model for the scatter plots
    batch_rows: int = 32  # rows per model forward pass
    max_points: int = 3000  # active tokens drawn per scatter panel (its correlation uses all)
    hist_rank: int = 2  # rank whose correlations are histogrammed and quoted per candidate
    label_chars: int = 48  # feature descriptions longer than this are cut in figure labels
    dpi: int = 100  # resolution of the PNG figures


def write_report(
    run: RunPaths,
    cfg: ReportConfig | None = None,
    tokens: torch.Tensor | None = None,
    model: HookedTransformer | None = None,
    sae_paths: dict[int, tuple[Path, Path]] | None = None,
    model_dir: Path | None = None,
) -> Path:
    """Write `run.report/index.html` and its figures; returns the page's path.

    `tokens` `[n_seq, n_ctx]` feed the scatter plots; by default the first
    `cfg.scatter_rows` held-out rows of the run's built-in corpus are used. `model`
    (default: loaded from `model_dir`, itself defaulting to the run's `lm/`, which also gives
    the tokenizer) and `sae_paths[layer] = (input SAE, output SAE)` (default: the run's
    `saes/`) must be those the circuit tables were computed with, as given to
    `pipelines.stages.ensure_circuits`. The report is built in a temporary folder that then
    replaces the old one, so no stale figure survives.
    """
    cfg = cfg or ReportConfig()
    run.root.mkdir(parents=True, exist_ok=True)
    tmp = run.root / f".report.{uuid.uuid4().hex}.tmp"
    tmp.mkdir()
    try:
        page = _page(_Builder(run, cfg, tmp, tokens, model, sae_paths or {}, model_dir or run.lm))
        (tmp / INDEX).write_text(page, encoding="utf-8")
        if run.report.exists():
            shutil.rmtree(run.report)
        tmp.rename(run.report)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return run.report / INDEX


class _Builder:
    """The run's tables and lazily loaded model and SAEs, shared by the sections."""

    def __init__(self, run: RunPaths, cfg: ReportConfig, folder: Path, tokens: torch.Tensor | None,
                 model: HookedTransformer | None, sae_paths: dict[int, tuple[Path, Path]],
                 model_dir: Path):
        self.run, self.cfg, self.folder, self.tokens = run, cfg, folder, tokens
        self.sae_paths, self.model_dir = sae_paths, Path(model_dir)
        self.tables = {name: _read(run, name) for name in
                       ("sae_metrics", "lowrank", "eigen", "gates", "interactions", "features")}
        features = self.tables["features"]
        self._features = (None if features is None
                          else features.set_index(["layer", "site", "feature"]).sort_index())
        self._model = model
        self._layers: dict[int, _LayerWeights] = {}

    @functools.cached_property
    def tokenizer(self):
        """The model's tokenizer, or None when there is none (tokens were passed in)."""
        path = self.model_dir / "tokenizer.json"
        return load_tokenizer(path) if path.is_file() else None

    @property
    def model(self):
        if self._model is None:
            self._model, _ = load_model(self.model_dir)
            self._model.eval()
        return self._model

    def layer(self, layer: int) -> "_LayerWeights":
        if layer not in self._layers:
            self._layers[layer] = _LayerWeights.load(self.model, layer, *self.saes(layer))
        return self._layers[layer]

    def saes(self, layer: int) -> tuple[Path, Path]:
        """(input SAE, output SAE) folders of a layer."""
        default = (self.run.sae(layer, "resid_mid"), self.run.sae(layer, "mlp_out"))
        return self.sae_paths.get(layer, default)

    def save(self, fig: Figure, name: str) -> str:
        """Write `fig` as `name` in the report folder; returns the relative path for <img>."""
        fig.savefig(self.folder / name, dpi=self.cfg.dpi)
        return name

    def feature(self, layer: int, site: str, feature: int) -> dict:
        """The features-table row of a feature, or {} when it is not described."""
        if self._features is None or (layer, site, feature) not in self._features.index:
            return {}
        return self._features.loc[(layer, site, feature)].to_dict()

    def label(self, layer: int, site: str, feature: int, width: int | None = None) -> str:
        """`#f description`, cut to `width` characters (for figures), unescaped."""
        info = self.feature(layer, site, feature)
        text = info.get("description") or ""
        if not text and _listlike(info.get("top_tokens")):
            text = "on " + ", ".join(map(str, list(info["top_tokens"])[:3]))
        text = f"#{feature} {text}".strip()
        return _cut(text, width) if width else text


@dataclass
class _LayerWeights:
    """One layer's MLP in float64, its input basis and output directions."""

    mlp: MLPWeights
    basis: torch.Tensor  # [d, n_in + 1], last column the constant coordinate
    directions: torch.Tensor  # [n_out, d]: output-SAE encoder rows, or HOSVD directions
    sae_out: object | None  # the sae-lens output SAE, None when the layer has none

    @classmethod
    def load(cls, model: HookedTransformer, layer: int, in_path: Path, out_path: Path) -> "_LayerWeights":
        mlp = from_hooked_transformer(model, layer).to(torch.float64)
        sae_in = from_sae_lens(load_sae(in_path, model=model)).to(torch.float64)
        basis = input_basis(sae_in.W_dec, sae_in.b_dec, mlp.g)
        if Path(out_path).is_dir():
            sae_out = load_sae(out_path, model=model)
            directions = output_directions(from_sae_lens(sae_out).to(torch.float64).W_enc)
        else:
            # without an output SAE the tables' out_feature is a HOSVD component
            sae_out = None
            directions = hosvd(mlp.W_gate, mlp.W_in, mlp.W_out)[1].T
        return cls(mlp, basis, directions, sae_out)

    def interaction_matrix(self, feature: int) -> torch.Tensor:
        """`Q [d, d]` of one output feature in the model basis."""
        u = self.directions[feature : feature + 1]
        return interaction_matrices(self.mlp.W_gate, self.mlp.W_in, self.mlp.W_out, u)[0]

    def projected(self, feature: int, inputs: list[int]) -> torch.Tensor:
        """`Qt` restricted to the given input features: `[len(inputs), len(inputs)]`."""
        M = self.basis[:, inputs]
        return M.T @ self.interaction_matrix(feature) @ M


def _read(run: RunPaths, name: str) -> pd.DataFrame | None:
    try:
        return read_table(run.tables, name)
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------- page


def _page(b: _Builder) -> str:
    sections = [
        _summary(b),
        _correlation_by_rank(b),
        _correlation_histograms(b),
        _scatters(b),
        _gates(b),
    ]
    title = f"Bilinear circuits report: {b.run.root.name}"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{_esc(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{_esc(title)}</h1>" + "".join(sections) + "</body></html>\n"
    )


STYLE = """
body { font-family: sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; font-size: 0.9em; margin: .5em 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
td.text, th.text { text-align: left; }
th { background: #f3f3f3; }
img { max-width: 100%; }
.note { color: #555; font-size: 0.92em; }
.card { border: 1px solid #ddd; border-radius: 4px; padding: .5em 1em; margin: 1em 0; }
.figs { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
code { background: #f5f5f5; padding: 0 .2em; }
"""


def _section(title: str, *parts: str) -> str:
    return f"<h2>{_esc(title)}</h2>" + "".join(parts)


def _p(text: str, cls: str | None = None) -> str:
    attr = f' class="{cls}"' if cls else ""
    return f"<p{attr}>{_esc(text)}</p>"


def _img(src: str, alt: str) -> str:
    return f'<img src="{_esc(src)}" alt="{_esc(alt)}">'


def _missing(what: str) -> str:
    return _p(f"Not available: {what}.", "note")


def _html_table(df: pd.DataFrame, text_columns: tuple[str, ...] = ()) -> str:
    """A table with every cell escaped; floats to 4 significant digits."""
    head = "".join(
        f'<th class="{"text" if c in text_columns else ""}">{_esc(str(c))}</th>' for c in df.columns
    )
    rows = []
    for record in df.itertuples(index=False):
        cells = "".join(
            f'<td class="{"text" if c in text_columns else ""}">{_esc(_fmt(v))}</td>'
            for c, v in zip(df.columns, record)
        )
        rows.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


# ---------------------------------------------------------------- 1. summary


def _summary(b: _Builder) -> str:
    parts = [_model_table(b)]
    metrics = b.tables["sae_metrics"]
    if metrics is None:
        parts.append(_missing("SAE metrics table"))
    else:
        columns = [c for c in METRIC_COLUMNS if c in metrics.columns]
        order = metrics.assign(_site=metrics["site"] != "resid_mid").sort_values(["layer", "_site"])
        parts.append("<h3>SAEs</h3>" + _html_table(order[columns], ("site",)))
    parts.append(EXPLANATION)
    return _section("Summary", *parts)


def _model_table(b: _Builder) -> str:
    """The run's model config, or the shape of a model passed in without one."""
    if (b.run.lm / "config.json").is_file():
        return _html_table(pd.DataFrame([asdict(load_config(b.run.lm))]))
    try:
        model_cfg = b.model.cfg
    except FileNotFoundError:
        return _missing("model config (no checkpoint in lm/)")
    names = ("n_layers", "d_model", "n_heads", "d_mlp", "n_ctx", "d_vocab")
    return _html_table(pd.DataFrame([{name: getattr(model_cfg, name) for name in names}]))


EXPLANATION = (
    "<h3>How to read the numbers</h3><ul>"
    "<li><b>nmse</b>: squared reconstruction error over the total variance of the activations "
    "around their mean (0 is perfect, 1 is no better than the mean). <b>l0</b>: mean active "
    "latents per token. <b>dead_fraction</b>: share of latents that never fire on the "
    "evaluation tokens. <b>loss_added</b>: relative increase of the LM's next-token loss when "
    "the reconstruction replaces the activation, (L_patched - L_clean) / L_clean.</li>"
    "<li>Each output feature of the <code>mlp_out</code> SAE is read by its encoder row u, so "
    "its part of the MLP is the quadratic form x<sup>T</sup>Q<sub>u</sub>x of the MLP input x. "
    "Expressed in the <code>resid_mid</code> SAE's latents z (plus a constant coordinate for "
    "b_dec) it becomes z'<sup>T</sup>Qt z'. These interactions are exact up to the input "
    "SAE's reconstruction error and a positive per-token factor 1/rms(resid_mid)<sup>2</sup> "
    "(from the RMS norm), which rescales every term of a token alike: it changes magnitudes, "
    "not which interactions dominate.</li>"
    "<li>The rank-r approximation keeps the r largest-magnitude eigenpairs of Q<sub>u</sub>, "
    "sum<sub>i&le;r</sub> &lambda;<sub>i</sub> (v<sub>i</sub>&middot;x)<sup>2</sup>. Its "
    "correlation with the feature's real activation is measured only over tokens where the "
    "feature is active, so the many zeros of a sparse feature do not inflate it; features "
    "with too few active tokens have no correlation (NaN) and are counted, not dropped "
    "silently. At full rank the correlation is 1 up to rounding: a TopK feature's activation "
    "equals its pre-activation where it is active.</li>"
    "<li>AND-gate score of an input pair (a, b): cross - |self_a| - |self_b|, where cross "
    "multiplies z<sub>a</sub>z<sub>b</sub> and self_a multiplies z<sub>a</sub><sup>2</sup>: "
    "high when the pair drives the output together but neither input does alone.</li></ul>"
)


# ---------------------------------------------------------------- 2, 3. correlations


def _correlation_by_rank(b: _Builder) -> str:
    title = "Low-rank correlations per layer"
    lowrank = b.tables["lowrank"]
    if lowrank is None:
        return _section(title, _missing("lowrank table (layers without an output SAE have none)"))
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    for layer, df in lowrank.groupby("layer"):
        mean = df.groupby("n_eigs")["corr_active"].mean()  # pandas skips NaN
        ax.plot(mean.index, mean.values, marker="o", label=f"layer {layer}")
    ax.set_xlabel("eigenvectors r")
    ax.set_ylabel("mean active-only correlation")
    ax.grid(alpha=0.3)
    ax.legend()
    src = b.save(fig, "correlation_by_rank.png")
    caption = (
        "Mean over output features of the Pearson correlation between the rank-r approximation "
        "and the feature's activation, over tokens where the feature is active. Left out for "
        f"having no correlation (too few active tokens or no variance): {_nan_counts(lowrank)}."
    )
    return _section(title, _img(src, "mean correlation against r per layer"), _p(caption, "note"))


def _nan_counts(lowrank: pd.DataFrame) -> str:
    """'layer 0: 3 of 512, ...': features whose correlation is NaN at some rank."""
    parts = []
    for layer, df in lowrank.groupby("layer"):
        nan = df.loc[df["corr_active"].isna(), "out_feature"].nunique()
        parts.append(f"layer {layer}: {nan} of {df['out_feature'].nunique()}")
    return ", ".join(parts)


def _correlation_histograms(b: _Builder) -> str:
    r = b.cfg.hist_rank
    title = f"Distribution of rank-{r} correlations"
    lowrank = b.tables["lowrank"]
    if lowrank is None:
        return _section(title, _missing("lowrank table"))
    at_r = lowrank[lowrank["n_eigs"] == r]
    layers = sorted(at_r["layer"].unique())
    if not layers:
        return _section(title, _missing(f"correlations at rank {r} (the tables stop at a lower rank)"))
    fig = Figure(figsize=(3.2 * len(layers), 3), layout="constrained")
    axes = fig.subplots(1, len(layers), squeeze=False, sharey=True)[0]
    for ax, layer in zip(axes, layers):
        values = at_r.loc[at_r["layer"] == layer, "corr_active"]
        ax.hist(values.dropna(), bins=np.linspace(-1, 1, 41), color="tab:blue")
        ax.set_title(f"layer {layer} (NaN: {int(values.isna().sum())})", fontsize=10)
        ax.set_xlabel(f"rank-{r} correlation")
    axes[0].set_ylabel("output features")
    src = b.save(fig, f"rank{r}_histograms.png")
    caption = f"Active-only correlation of each output feature's rank-{r} approximation, per layer."
    return _section(title, _img(src, f"histograms of rank-{r} correlations"), _p(caption, "note"))


# ---------------------------------------------------------------- 4. scatter plots


def _scatters(b: _Builder) -> str:
    title = "Approximation versus activation"
    gates = b.tables["gates"]
    if gates is None:
        return _section(title, _missing("gates table, which picks the features shown"))
    chosen = [(layer, f) for layer, f in _candidates(b).head(b.cfg.n_scatter)[["layer", "out_feature"]]
              .itertuples(index=False) if Path(b.saes(layer)[1]).is_dir()]
    if not chosen:
        return _section(title, _missing("output SAEs of the top gate candidates"))
    tokens = _scatter_tokens(b)
    if tokens is None:
        return _section(title, _missing("tokens (no built-in corpus in the run; pass tokens)"))
    d = b.model.cfg.d_model
    ranks = sorted({r for r in b.cfg.scatter_ranks if 1 <= r < d}) + [d]  # the last is full rank
    points = _collect_points(b, tokens, chosen, ranks)
    parts = [_p(
        f"Output features of the top AND-gate candidates, on {tokens.shape[0]} corpus rows. "
        "x: the rank-r approximation sum_{i<=r} lambda_i (v_i . x)^2 at the real MLP input; "
        "y: the output SAE's activation; only tokens where the feature is active. The full-rank "
        "panel is the whole quadratic form, so it lies on a line (offset: the bias terms).",
        "note")]
    for (layer, f), (approx, act) in points.items():
        if len(act) == 0:
            parts.append(_p(f"Layer {layer}, output feature #{f}: never active on these rows.", "note"))
            continue
        fig = _scatter_figure(b, layer, f, ranks, approx, act)
        parts.append(_img(b.save(fig, f"scatter_L{layer}_F{f}.png"), f"scatter layer {layer} feature {f}"))
    return _section(title, *parts)


def _scatter_tokens(b: _Builder) -> torch.Tensor | None:
    """The rows the scatter plots run on: given tokens, else the run corpus's held-out rows."""
    n = b.cfg.scatter_rows
    if b.tokens is not None:
        return b.tokens[:n]
    if not b.run.corpus.is_dir():
        return None
    if b.tokenizer is None:
        return None
    train, held_out = token_rows(str(b.run.corpus), b.tokenizer, b.model.cfg.n_ctx)
    # held-out rows first: neither the LM nor the SAEs trained on them
    return torch.cat([held_out.tokens, train.tokens[: max(0, n - len(held_out))]])[:n]


def _keep(b: _Builder, tokens: torch.Tensor) -> torch.Tensor:
    """All positions but BOS, which the SAEs never trained on."""
    tok = b.tokenizer
    return keep_mask(tokens, bos_id=None if tok is None else tok.token_to_id(BOS))


@torch.no_grad()
def _collect_points(
    b: _Builder, tokens: torch.Tensor, chosen: list[tuple[int, int]], ranks: list[int]
) -> dict:
    """For each (layer, feature), over its active tokens: (approximations [n, len(ranks)],
    activations [n])."""
    eig = {}
    for layer, f in chosen:
        lam, V = eigh_by_magnitude(b.layer(layer).interaction_matrix(f).unsqueeze(0))
        eig[(layer, f)] = (lam[0], V[0])
    layers = sorted({layer for layer, _ in chosen})
    points = [(layer, site) for layer in layers for site in ("mlp_in", "mlp_out")]
    columns = torch.tensor(ranks) - 1
    found = {key: ([], []) for key in chosen}
    batches = iter_activations(b.model, tokens, points, keep=_keep(b, tokens), batch_seqs=b.cfg.batch_rows)
    for acts in batches:
        latents = {}
        for layer in layers:
            sae_out = b.layer(layer).sae_out
            latents[layer] = sae_out.encode(acts[(layer, "mlp_out")].to(sae_out.W_enc.dtype))
        for (layer, f), (lam, V) in eig.items():
            active = latents[layer][:, f] > 0
            x = acts[(layer, "mlp_in")][active].double()
            found[(layer, f)][0].append((lam * (x @ V).square()).cumsum(-1)[:, columns])
            found[(layer, f)][1].append(latents[layer][active, f].double())
    return {key: (torch.cat(a), torch.cat(y)) for key, (a, y) in found.items()}


def _scatter_figure(b: _Builder, layer: int, f: int, ranks: list[int], approx: torch.Tensor,
                    act: torch.Tensor) -> Figure:
    fig = Figure(figsize=(3.4 * len(ranks), 3.2), layout="constrained")
    axes = fig.subplots(1, len(ranks), squeeze=False)[0]
    shown = torch.randperm(len(act), generator=torch.Generator().manual_seed(0))[: b.cfg.max_points]
    y = act.numpy()
    for column, (ax, r) in enumerate(zip(axes, ranks)):
        x = approx[:, column].numpy()
        ax.scatter(x[shown], y[shown], s=4, alpha=0.4, linewidths=0)
        name = f"full rank ({r})" if r == ranks[-1] else f"rank {r}"
        ax.set_title(f"{name}: corr {_pearson(x, y):.3f}", fontsize=10)
        ax.set_xlabel(f"{name} approximation")
    axes[0].set_ylabel("SAE activation")
    label = _mpl(b.label(layer, "mlp_out", f, 2 * b.cfg.label_chars))
    fig.suptitle(f"layer {layer}, output {label} ({len(act)} active tokens)", fontsize=10)
    return fig


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 2 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


# ---------------------------------------------------------------- 5. AND-gate candidates


def _candidates(b: _Builder) -> pd.DataFrame:
    """Each layer's best gate candidates; on the built-in corpus, negation gates come first."""
    cands = top_gates(b.tables["gates"], b.cfg.gates_per_layer)
    features = b.tables["features"]
    if features is not None and "share_negation" in features.columns:
        cands = label_gates(cands, features).sort_values(
            ["is_negation_gate", "and_score"], ascending=False, kind="stable").reset_index(drop=True)
    return cands


def _gates(b: _Builder) -> str:
    title = "AND-gate candidates"
    if b.tables["gates"] is None:
        return _section(title, _missing("gates table"))
    cands = _candidates(b)
    columns = GATE_COLUMNS + (["is_negation_gate"] if "is_negation_gate" in cands.columns else [])
    overview = cands[columns].copy()
    for side, column in (("output", "out_feature"), ("input a", "in_a"), ("input b", "in_b")):
        site = "mlp_out" if column == "out_feature" else "resid_mid"
        overview[side] = [b.label(layer, site, f) for layer, f in zip(overview["layer"], overview[column])]
    parts = [] if b.tables["features"] is not None else [
        _missing("features table: features are shown by index only")]
    parts += [
        _p(f"Best pair of each output feature; the {b.cfg.gates_per_layer} best by AND-gate score "
           "in each layer (scales differ between layers). Negation gates, judged by the corpus's "
           "ground truth, come first: one input fires within negations, the other in contexts "
           "of one valence, and the output predicts words of the other valence. Coefficients "
           "are those of z'^T Qt z' (cross multiplies z_a z_b, self_a multiplies z_a^2).", "note"),
        _html_table(overview, ("output", "input a", "input b")),
    ]
    for i, row in enumerate(cands.head(b.cfg.n_gates).itertuples(index=False)):
        parts.append(_gate_card(b, i + 1, row))
    return _section(title, *parts)


def _gate_card(b: _Builder, i: int, row) -> str:
    layer, f = int(row.layer), int(row.out_feature)
    info = b.feature(layer, "mlp_out", f)
    inputs = _card_inputs(b, layer, f, int(row.in_a), int(row.in_b))
    Qt = b.layer(layer).projected(f, inputs).numpy()
    if b.layer(layer).sae_out is None and Qt[0, 1] * row.cross < 0:
        Qt = -Qt  # a HOSVD direction's sign is arbitrary: use the one the tables were written with
    heatmap = b.save(_heatmap(b, layer, f, inputs, Qt), f"gate{i}_L{layer}_F{f}_interactions.png")
    figs = [_img(heatmap, f"interactions of layer {layer} feature {f}")]
    spectrum = _spectrum(b, layer, f)
    if spectrum is not None:
        figs.append(_img(b.save(spectrum, f"gate{i}_L{layer}_F{f}_eigen.png"), "eigenvalue spectrum"))
    lines = [
        f"Output: {b.label(layer, 'mlp_out', f)}",
        f"Boosts: {_tokens(info.get('boosted_tokens'))}; "
        f"suppresses: {_tokens(info.get('suppressed_tokens'))}",
        f"Pair: {b.label(layer, 'resid_mid', int(row.in_a))} "
        f"AND {b.label(layer, 'resid_mid', int(row.in_b))}",
        f"AND score {row.and_score:.4g} = cross {row.cross:.4g} - |{row.self_a:.4g}| - |{row.self_b:.4g}|",
        _rank_correlation(b, layer, f),
    ]
    body = "".join(_p(line) for line in lines)
    caption = _p(
        "Heatmap: Qt over the pair and the output's strongest input features (diagonal: self "
        "coefficient; off-diagonal entries are half the cross coefficient). Linear and constant "
        "terms (b_dec) are left out.", "note")
    return (f'<div class="card"><h3>{_esc(f"#{i}: layer {layer}, output feature {f}")}</h3>'
            f'{body}<div class="figs">{"".join(figs)}</div>{caption}</div>')


def _card_inputs(b: _Builder, layer: int, f: int, a: int, c: int) -> list[int]:
    """The gate pair, then the inputs of the feature's strongest interactions, `n_inputs` in all."""
    inputs = [a, c]
    table = b.tables["interactions"]
    if table is not None:
        rows = table[(table["layer"] == layer) & (table["out_feature"] == f)].sort_values("rank")
        for index in rows[["in_a", "in_b"]].to_numpy().ravel():
            if len(inputs) >= b.cfg.n_inputs:
                break
            if index >= 0 and index not in inputs:  # -1 is the constant coordinate
                inputs.append(int(index))
    return inputs


def _heatmap(b: _Builder, layer: int, f: int, inputs: list[int], Qt: np.ndarray) -> Figure:
    n = len(inputs)
    fig = Figure(figsize=(4.5 + 0.09 * b.cfg.label_chars, 1.2 + 0.5 * n), layout="constrained")
    ax = fig.add_subplot()
    scale = float(np.abs(Qt).max()) or 1.0
    image = ax.imshow(Qt, cmap="RdBu_r", vmin=-scale, vmax=scale)
    labels = [_mpl(b.label(layer, "resid_mid", i, b.cfg.label_chars)) for i in inputs]
    ax.set_yticks(range(n), labels, fontsize=8)
    ax.set_xticks(range(n), [f"#{i}" for i in inputs], fontsize=8, rotation=45)
    for (r, c), value in np.ndenumerate(Qt):
        ax.text(c, r, f"{value:.2g}", ha="center", va="center", fontsize=6,
                color="white" if abs(value) > 0.6 * scale else "black")
    fig.colorbar(image, ax=ax, shrink=0.8)
    ax.set_title(f"Qt of layer {layer}, output #{f}", fontsize=10)
    return fig


def _spectrum(b: _Builder, layer: int, f: int) -> Figure | None:
    eigen = b.tables["eigen"]
    if eigen is None:
        return None
    rows = eigen[(eigen["layer"] == layer) & (eigen["out_feature"] == f)].sort_values("rank")
    rows = rows.head(b.cfg.n_eigen_bars)
    if rows.empty:
        return None
    fig = Figure(figsize=(4.5, 3.2), layout="constrained")
    ax = fig.add_subplot()
    colors = np.where(rows["eigenvalue"] >= 0, "tab:red", "tab:blue")
    ax.bar(rows["rank"], rows["eigenvalue"], color=colors)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xlabel("rank (by |eigenvalue|)")
    ax.set_ylabel("eigenvalue")
    ax.set_title(f"eigenvalues of Q, layer {layer}, output #{f}", fontsize=10)
    return fig


def _rank_correlation(b: _Builder, layer: int, f: int) -> str:
    r = b.cfg.hist_rank
    lowrank = b.tables["lowrank"]
    if lowrank is None:
        return f"Rank-{r} correlation: not available."
    rows = lowrank[(lowrank["layer"] == layer) & (lowrank["out_feature"] == f) & (lowrank["n_eigs"] == r)]
    if rows.empty:
        return f"Rank-{r} correlation: not in the lowrank table."
    corr, n_active = rows.iloc[0]["corr_active"], int(rows.iloc[0]["n_active"])
    if pd.isna(corr):
        return f"Rank-{r} active-only correlation: none ({n_active} active tokens: too few, or no variance)."
    return f"Rank-{r} active-only correlation: {corr:.3f} over {n_active} active tokens."


# ---------------------------------------------------------------- text helpers


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _fmt(value) -> str:
    if isinstance(value, (float, np.floating)):
        return "NaN" if np.isnan(value) else f"{value:.4g}"
    if _listlike(value):
        return ", ".join(map(str, value))
    return str(value)


def _listlike(value) -> bool:
    return isinstance(value, (list, tuple, np.ndarray))


def _tokens(value) -> str:
    return ", ".join(map(str, value)) if _listlike(value) and len(value) else "n/a"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def _mpl(text: str) -> str:
    """Text for matplotlib labels: a literal `$` would otherwise start mathtext."""
    return text.replace("$", r"\$")
