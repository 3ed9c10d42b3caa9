"""Measured sizes of the differences between the paper authors' code and ours.

    python benchmarks/reference_differences.py                      # random weights + results/demo
    python benchmarks/reference_differences.py /work/runs/demo_s0   # another run directory
    python benchmarks/reference_differences.py --no-run             # random weights only

The authors' behaviours are written here from a description of their public code
(tdooms/bilinear-decomposition, tdooms/bilinear-interp), independently of it:

1. Their `Tracer.q(project=False)` returns `Q_u = W_l^T diag(W_p u) W_r` *unsymmetrised*
   (ours: `W_gate diag(W_out u) W_in^T`, the same matrix), and their spectra call
   `torch.linalg.eigvalsh` / `eigh` on it. Those read one triangle (the lower, by default),
   i.e. they decompose `tril(Q) + tril(Q, -1)^T`, not `sym(Q) = (Q + Q^T) / 2`.
2. `compute_self_and_cross_outliers` flags IQR outliers among the strict lower triangle,
   flattened in `torch.tril_indices(n, n, offset=-1)` order, and maps the flat index k
   back with `unravel_index(k, (n, n)) = (k // n, k % n)` instead of the triangle's own
   `(rows[k], cols[k])`.
3. Conventions where we differ on purpose: the constant coordinate `b_dec` of the input
   basis (they keep decoder columns only), the active-token threshold of a correlation
   (theirs nnz > 10, ours `min_active` 20), BOS handling, TopK without ReLU, and their
   "top 2" histogram, which plots index 2 of a cumulative sum (the top 3).

Every number printed is measured by this script, on random weights (seeded) and, when the
run directory holds a demo run (model in `lm/`, SAEs in `saes/layer{l}_{site}`, tables in
`tables/`), on that run's weights, SAEs, held-out rows and tables. Nothing is written (except
that `ensure_tokens` builds the run's token store if it has none, as every stage does).
Takes about two minutes on a busy 2-core machine with one torch thread.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from circuits.bilinear import symmetrise  # noqa: E402
from circuits.sites import MLP_IN, MLP_OUT, RESID_MID  # noqa: E402
from circuits.sae_basis import preactivation_offset, token_scale  # noqa: E402
from circuits.spectra import ActiveCorrelation, eigh_by_magnitude, lowrank_at  # noqa: E402
from pipelines.inputs import SAE_OUTPUTS, part_name  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script
from results_file import add_output, run_recorded  # noqa: E402

OUTPUT = "reference_differences.txt"  # under benchmarks/results/

F64 = torch.float64


# ------------------------------------------------------------------ the authors' behaviours


def unsymmetrised_q(W_gate: torch.Tensor, W_in: torch.Tensor, W_out: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """`Q_u = W_gate diag(W_out u) W_in^T` for each row u of U, *not* symmetrised. `[n, d, d]`."""
    weights = U @ W_out.T  # [n, h]
    return torch.einsum("ih,nh,jh->nij", W_gate, weights, W_in)


def lower_mirror(Q: torch.Tensor) -> torch.Tensor:
    """The symmetric matrix `eigvalsh`/`eigh` (UPLO='L') decompose when given Q: its lower
    triangle mirrored onto the upper one."""
    return torch.tril(Q) + torch.tril(Q, -1).transpose(-1, -2)


def top_abs_sum(lam: torch.Tensor, k: int = 2) -> torch.Tensor:
    """Sum of the k largest |eigenvalues| (their `compute_truncated_eigenvalues`, k=2)."""
    return lam.abs().topk(k, dim=-1).values.sum(-1)


def iqr_outliers(values: torch.Tensor, factor: float = 1.5) -> torch.Tensor:
    """Per row, the mask of values outside `[q1 - f IQR, q3 + f IQR]` (linear quantiles)."""
    q1 = torch.quantile(values, 0.25, dim=1, keepdim=True)
    q3 = torch.quantile(values, 0.75, dim=1, keepdim=True)
    iqr = q3 - q1
    return (values < q1 - factor * iqr) | (values > q3 + factor * iqr)


def pct(x: float) -> str:
    return f"{100 * x:.1f}%" if np.isfinite(x) else "n/a"


# ------------------------------------------------------------------ 1a: random weights


def random_weights_eigen(sizes: list[int], seeds: list[int], n_dirs: dict[int, int]) -> None:
    print("\n1(a) Unsymmetrised eigendecomposition, random weights")
    print("    W_gate, W_in ~ randn(d, 4d)/sqrt(d), W_out ~ randn(4d, d)/sqrt(4d), u random unit vectors;")
    print("    every ratio below is scale-free (Q is linear in the weights and in u).")
    print("    their eigvalsh(Q) (lower triangle) vs eigvalsh(sym(Q)), eigenvalues compared in sorted order")
    print(f"    {'d_model':>7} {'mats':>5} {'|Q-Q^T|/|Q+Q^T|':>16} {'max|lam|':>9} {'max|dlam|':>17} "
          f"{'max|dlam|/max|lam|':>19} {'top-2 rel. error':>17}")
    print(f"    {'':>7} {'':>5} {'Frobenius, median':>16} {'median':>9} {'median / max':>17} "
          f"{'median / max':>19} {'median / max':>17}")
    for d in sizes:
        h = 4 * d
        asym, rel_lam, rel_top2, abs_lam, top = [], [], [], [], []
        for seed in seeds:
            gen = torch.Generator().manual_seed(seed)
            W_gate = torch.randn(d, h, generator=gen, dtype=F64) / d ** 0.5
            W_in = torch.randn(d, h, generator=gen, dtype=F64) / d ** 0.5
            W_out = torch.randn(h, d, generator=gen, dtype=F64) / h ** 0.5
            U = torch.randn(n_dirs[d], d, generator=gen, dtype=F64)
            U /= U.norm(dim=1, keepdim=True)
            Q = unsymmetrised_q(W_gate, W_in, W_out, U)
            theirs = torch.linalg.eigvalsh(Q)  # reads the lower triangle only
            assert torch.allclose(theirs, torch.linalg.eigvalsh(lower_mirror(Q)), rtol=1e-9, atol=1e-9)
            ours = torch.linalg.eigvalsh(symmetrise(Q.clone()))
            scale = ours.abs().amax(-1)
            asym.append((Q - Q.mT).norm(dim=(-2, -1)) / (Q + Q.mT).norm(dim=(-2, -1)))
            rel_lam.append((theirs - ours).abs().amax(-1) / scale)
            abs_lam.append((theirs - ours).abs().amax(-1))
            top.append(scale)
            rel_top2.append((top_abs_sum(theirs) - top_abs_sum(ours)).abs() / top_abs_sum(ours))
        asym, rel_lam, rel_top2 = torch.cat(asym), torch.cat(rel_lam), torch.cat(rel_top2)
        abs_lam, top = torch.cat(abs_lam), torch.cat(top)
        print(f"    {d:>7} {len(asym):>5} {asym.median().item():>16.3f} {top.median().item():>9.3f} "
              f"{f'{abs_lam.median().item():.3f} / {abs_lam.max().item():.3f}':>17} "
              f"{f'{pct(rel_lam.median().item())} / {pct(rel_lam.max().item())}':>19} "
              f"{f'{pct(rel_top2.median().item())} / {pct(rel_top2.max().item())}':>17}")


# ------------------------------------------------------------------ 2: outlier positions


def outlier_positions(n: int, n_mats: int, n_cross: int, n_self: int, seed: int) -> None:
    print("\n2. Outlier positions in compute_self_and_cross_outliers (planted outliers)")
    gen = torch.Generator().manual_seed(seed)
    rows, cols = torch.tril_indices(n, n, offset=-1)
    M = rows.numel()
    A = torch.randn(n_mats, n, n, generator=gen, dtype=F64)
    A = symmetrise(A)
    planted = torch.stack([torch.randperm(M, generator=gen)[:n_cross] for _ in range(n_mats)])  # flat indices
    signs = torch.where(torch.rand(n_mats, n_cross, generator=gen) < 0.5, -1.0, 1.0).to(F64)
    size = 8 + 4 * torch.rand(n_mats, n_cross, generator=gen, dtype=F64)
    mats = torch.arange(n_mats)[:, None].expand_as(planted)
    A[mats, rows[planted], cols[planted]] = signs * size
    A[mats, cols[planted], rows[planted]] = signs * size
    diag = torch.stack([torch.randperm(n, generator=gen)[:n_self] for _ in range(n_mats)])
    A[torch.arange(n_mats)[:, None].expand_as(diag), diag, diag] = 8 + 4 * torch.rand(n_mats, n_self, generator=gen,
                                                                                       dtype=F64)

    flat = A[:, rows, cols]  # [n_mats, M], tril_indices order
    cross = iqr_outliers(flat)
    selv = iqr_outliers(A.diagonal(dim1=-2, dim2=-1))
    m_idx, k = cross.nonzero(as_tuple=True)
    right_i, right_j = rows[k], cols[k]
    wrong_i, wrong_j = k // n, k % n  # = torch.unravel_index(k, (n, n))
    assert all(torch.equal(a, b) for a, b in zip(torch.unravel_index(k, (n, n)), (wrong_i, wrong_j)))

    is_planted = torch.zeros(n_mats, M, dtype=torch.bool)
    is_planted[mats, planted] = True
    p = is_planted[m_idx, k]
    found = int(p.sum())
    moved = (wrong_i != right_i) | (wrong_j != right_j)
    on_diag = wrong_i == wrong_j
    upper = wrong_j > wrong_i
    on_self = on_diag & selv[m_idx, wrong_i.clamp_max(n - 1)]
    reachable_rows = (M - 1) // n + 1
    print(f"    {n_mats} random symmetric {n}x{n} matrices (N(0,1) entries), each with {n_cross} planted cross "
          f"outliers "
          f"(|value| 8-12, mirrored) and {n_self} planted self outliers;")
    print(f"    IQR rule (1.5 IQR) per matrix on the {M} strict-lower-triangle values; "
          f"{found} of {planted.numel()} planted cross outliers flagged, plus {int((~p).sum())} natural ones.")
    print("    triangle order (rows[k], cols[k]): every flagged value at its own position (by construction).")
    print(f"    their (k // n, k % n): planted outliers at a wrong position: {int(moved[p].sum())} of {found} "
          f"({pct(moved[p].float().mean().item())});")
    print(f"      on the diagonal: {int(on_diag[p].sum())} ({pct(on_diag[p].float().mean().item())}; "
          f"all flagged: {int(on_diag.sum())} of {len(k)}, {pct(on_diag.float().mean().item())}; "
          f"expected share {(M - 1) // (n + 1) + 1}/{M} = {pct(((M - 1) // (n + 1) + 1) / M)}), "
          f"{int(on_self.sum())} of them added onto a self outlier (2*cross + self);")
    print(f"      in the strict upper triangle (where no cross outlier is stored): {int(upper[p].sum())} "
          f"({pct(upper[p].float().mean().item())}); only rows 0..{reachable_rows - 1} of {n} can be reported, "
          f"while the planted ones lie in rows {int(rows[planted].min())}..{int(rows[planted].max())}.")


# ------------------------------------------------------------------ demo run


def read_layer_table(run: Path, name: str, layer: int, part: str, tries: int, wait: float) -> pd.DataFrame:
    """One layer's table, retried while another process (re)writes it."""
    path = run / "tables" / name / f"layer{layer}" / f"{part}.parquet"
    for attempt in range(tries):
        try:
            return pd.read_parquet(path)
        except Exception as err:  # missing or mid-write (written atomically, but be safe)
            if attempt == tries - 1:
                raise RuntimeError(f"cannot read {path} after {tries} tries: {err}") from err
            print(f"    ({path} not readable: {type(err).__name__}; retrying in {wait:.0f} s)", flush=True)
            time.sleep(wait)
    raise AssertionError


def demo_run(run: Path, n_rows: int, R: int, tries: int, wait: float) -> None:
    from pipelines.data.corpus import CorpusConfig
    from pipelines.data.story_corpus import story_lexicon
    from pipelines.engine.paths import RunPaths
    from pipelines.lm.model import load_model
    from pipelines.stages import ensure_tokens
    from pipelines.data.tokenizer import load_tokenizer
    from circuits.weights import from_hooked_transformer
    from sae.activations import iter_activations
    from sae.io import load_sae

    paths = RunPaths(run)
    model, cfg = load_model(paths.lm)
    tokenizer = load_tokenizer(paths.lm)
    store = ensure_tokens(paths, str(paths.corpus), tokenizer, cfg.n_ctx, story_lexicon(paths.corpus, CorpusConfig()))
    held = store.held_out
    n_rows = min(n_rows, len(held))
    layers = list(range(cfg.n_layers))
    eps = float(model.cfg.eps)

    mlps = {l: from_hooked_transformer(model, l).to(F64) for l in layers}
    sae_in = {l: load_sae(paths.sae(l, RESID_MID)).weights.to(F64) for l in layers}
    sae_out = {l: load_sae(paths.sae(l, MLP_OUT)).weights.to(F64) for l in layers}
    print(f"\nrun {run}: {cfg.n_layers} layers, d_model {cfg.d_model}, d_mlp {cfg.d_mlp}; input SAEs on resid_mid "
          f"({sae_in[0].d_sae} latents, k {sae_in[0].k}), output SAEs on mlp_out ({sae_out[0].d_sae}, "
          f"k {sae_out[0].k}); "
          f"held-out rows used: {n_rows} of {len(held)} (the circuits stage's corr_rows is 1024)")

    # ---------------- weights: spectra of every output feature (encoder rows as u)
    t0 = time.perf_counter()
    per_layer = {}
    for l in layers:
        mlp, out = mlps[l], sae_out[l]
        Q = unsymmetrised_q(mlp.W_gate, mlp.W_in, mlp.W_out, out.W_enc.T)  # [n_out, d, d]
        Qs = symmetrise(Q.clone())
        theirs = torch.linalg.eigvalsh(Q)
        lam_s, V_s = eigh_by_magnitude(Qs)
        ours = lam_s.sort(-1).values
        lam_L, V_L = eigh_by_magnitude(lower_mirror(Q))
        b = mlp.g * sae_in[l].b_dec  # MLP-input image of the input SAE's b_dec
        per_layer[l] = {
            "asym": ((Q - Q.mT).norm(dim=(-2, -1)) / (Q + Q.mT).norm(dim=(-2, -1))),
            "rel_top2": (top_abs_sum(theirs) - top_abs_sum(ours)).abs() / top_abs_sum(ours),
            "rel_lam": (theirs - ours).abs().amax(-1) / ours.abs().amax(-1),
            "lam_s": lam_s[:, :R].contiguous(), "V_s": V_s[:, :, :R].contiguous(),
            "lam_L": lam_L[:, :R].contiguous(), "V_L": V_L[:, :, :R].contiguous(),
            "L_full": lower_mirror(Q),
            "lin": 2 * (Qs @ b),  # [n_out, d]: linear term 2 b^T Q_f y
            "const": torch.einsum("i,fij,j->f", b, Qs, b),
            "c": preactivation_offset(out.W_enc, out.b_enc, out.b_dec, out.apply_b_dec_to_input,
                                      mlp.b_in @ mlp.W_out + mlp.b_out),
        }
    print(f"    (spectra of {len(layers)} x {sae_out[0].d_sae} interaction matrices: {time.perf_counter() - t0:.0f} s)")

    print("\n1(b) Unsymmetrised eigendecomposition, demo weights: every output feature (encoder rows as u)")
    print("    top-2 = sum of the two largest |eigenvalues|; their eigvalsh(Q) vs eigvalsh(sym(Q))")
    print(f"    {'layer':>5} {'feat':>5} {'|Q-Q^T|/|Q+Q^T|':>16} {'top-2 rel. error':>18} {'':>8} "
          f"{'max|dlam|/max|lam|':>19}")
    print(f"    {'':>5} {'':>5} {'median':>16} {'median':>18} {'p90':>8} {'median':>19}")
    for l in layers:
        s = per_layer[l]
        print(f"    {l:>5} {len(s['asym']):>5} {s['asym'].median().item():>16.3f} "
              f"{pct(s['rel_top2'].median().item()):>18} {pct(s['rel_top2'].quantile(0.9).item()):>8} "
              f"{pct(s['rel_lam'].median().item()):>19}")

    # ---------------- tokens: one pass over the held-out rows
    t0 = time.perf_counter()
    corr_s = {l: ActiveCorrelation(sae_out[l].d_sae, R + 1) for l in layers}  # last column: full rank
    corr_L = {l: ActiveCorrelation(sae_out[l].d_sae, R + 1) for l in layers}
    pairs = {l: {k: [] for k in ("feature", "target", "dec", "bterm")} for l in layers}
    neg = {(l, s): [0, 0, 0, 0, float("inf")] for l in layers for s in (RESID_MID, MLP_OUT)}
    # negative selections, selections, tokens with a negative one, tokens, smallest k-th value
    n_active_ours = {l: torch.zeros(sae_out[l].d_sae, dtype=torch.long) for l in layers}
    assert all(sae_in[l].relu and sae_out[l].relu and sae_in[l].k and sae_out[l].k for l in layers), \
        "expected TopK SAEs with ReLU (sae-lens format)"
    points = [(l, site) for l in layers for site in (RESID_MID, MLP_IN, MLP_OUT)]
    n_tokens = 0
    for _, tokens in held.iter_batches(64, n_rows):
        for acts in iter_activations(model, tokens, points, held.keep(tokens), 64):
            n_tokens += acts[(0, MLP_IN)].shape[0]
            for l in layers:
                mlp, si, so, s = mlps[l], sae_in[l], sae_out[l], per_layer[l]
                r = acts[(l, RESID_MID)].to(F64)
                x = acts[(l, MLP_IN)].to(F64)
                m = acts[(l, MLP_OUT)].to(F64)
                pre_in, pre_out = si.pre(r), so.pre(m)
                selected = {}
                for site, sae, pre in ((RESID_MID, si, pre_in), (MLP_OUT, so, pre_out)):
                    values, indices = pre.topk(sae.k, dim=-1)
                    selected[site] = torch.zeros_like(pre).scatter_(-1, indices, values).relu_()  # ours: ReLU
                    count = neg[(l, site)]
                    count[0] += int((values < 0).sum())
                    count[1] += values.numel()
                    count[2] += int((values < 0).any(-1).sum())
                    count[3] += values.shape[0]
                    count[4] = min(count[4], float(values[:, -1].min()))
                act = selected[MLP_OUT]  # ours: TopK then ReLU, = so.encode(m)
                token, feature = act.nonzero(as_tuple=True)
                n_active_ours[l] += torch.bincount(feature, minlength=so.d_sae)
                y = act[token, feature]
                # low-rank approximations with eigenpairs of sym(Q) (ours) and of the lower mirror (theirs)
                full_s = pre_out[token, feature] - s["c"][feature]  # = x^T sym(Q_f) x exactly (up to float32 acts)
                approx = lowrank_at(x, s["lam_s"], s["V_s"], token, feature)
                corr_s[l].update(torch.cat([approx, full_s[:, None]], 1), y, feature)
                approx = lowrank_at(x, s["lam_L"], s["V_L"], token, feature)
                corr_L[l].update(torch.cat([approx, _pair_forms(x, s["L_full"], token, feature)[:, None]], 1),
                                 y, feature)
                # the input SAE's reconstruction in the MLP-input basis, with and without b_dec
                scale = token_scale(r, eps, RESID_MID)
                y_dec = (selected[RESID_MID] @ si.W_dec) * mlp.g  # z = si.encode(r)
                dec = ((y_dec @ mlp.W_gate) * (y_dec @ mlp.W_in)) @ mlp.W_out @ so.W_enc  # [t, n_out]
                bterm = y_dec @ s["lin"].T + s["const"]
                if not pairs[l]["dec"]:  # check once: decoder-only + b-terms = the form of the full reconstruction
                    y_full = y_dec + mlp.g * si.b_dec
                    direct = ((y_full @ mlp.W_gate) * (y_full @ mlp.W_in)) @ mlp.W_out @ so.W_enc
                    assert torch.allclose(dec + bterm, direct, rtol=1e-9, atol=1e-9 * direct.abs().max().item())
                p = pairs[l]
                p["feature"].append(feature)
                p["target"].append(full_s)
                p["dec"].append((scale[:, None] * dec)[token, feature])
                p["bterm"].append((scale[:, None] * bterm)[token, feature])
    print(f"    (token pass over {n_tokens} held-out tokens, BOS dropped: {time.perf_counter() - t0:.0f} s)")

    print("\n1(c) What the unsymmetrised eigendecomposition does to the low-rank correlation (active tokens only;")
    print("    their ts_corr.py takes eigh of the unsymmetrised Q too): median over features with >= 20 active tokens")
    print(f"    {'layer':>5} {'rank 2':>16} {'rank 3':>16} {f'rank {R}':>16} {'full rank':>16}   "
          f"{'histogram mean':>22}")
    print(f"    {'':>5}" + f" {'ours / theirs':>16}" * 4 + f"   {'ours r=2 / their top 2':>22}")
    for l in layers:
        _, cs = corr_s[l].result(20)
        count, cL = corr_L[l].result(11)  # their histogram keeps nnz > 10
        cL20 = cL.masked_fill((count < 20)[:, None], float("nan"))
        cells = []
        for j in (1, 2, R - 1, R):
            cells.append(f"{np.nanmedian(cs[:, j].numpy()):.3f} / {np.nanmedian(cL20[:, j].numpy()):.3f}")
        hist = f"{np.nanmean(cs[:, 1].numpy()):.3f} / {np.nanmean(cL[:, 2].numpy()):.3f}"
        print(f"    {l:>5}" + "".join(f" {c:>16}" for c in cells) + f"   {hist:>22}")
    print("    (their top 2 = what their histogram averages: rank 3 (index 2), lower-triangle eigenvectors, features")
    print("    with > 10 active tokens; ours r=2: rank 2, sym(Q), >= 20 active tokens. Same tokens and active sets.)")

    # ---------------- 3: conventions
    print("\n3. Conventions where we differ on purpose")
    print("3.1 b_dec as a constant input coordinate (ours) vs decoder columns only (theirs).")
    print("    Per (token, output feature) on the feature's active tokens, with s = 1/rms(resid_mid)^2 and y the input")
    print("    SAE's reconstruction in the MLP-input basis: full = s y^T Q_f y (ours), decoder-only = s y_D^T Q_f y_D")
    print("    (y_D without b_dec, theirs), b-terms = full - decoder-only (the linear and constant terms).")
    print("    target = the output SAE's pre-activation minus its constant c_f (= x^T Q_f x on the real MLP input x).")
    print("    Medians over output features with >= 20 active tokens:")
    print(f"    {'layer':>5} {'feat':>5} {'|b|/(|dec|+|b|)':>16} {'var(b)/var(full)':>17} "
          f"{'corr(target, .)':>18} {'rel. error |target - .|/|target|':>33}")
    print(f"    {'':>5} {'':>5} {'':>16} {'':>17} {'full / dec-only':>18} {'full / dec-only':>33}")
    for l in layers:
        p = {k: torch.cat(v) for k, v in pairs[l].items()}
        f = p["feature"]
        n_out = sae_out[l].d_sae
        count = torch.bincount(f, minlength=n_out).double()
        full = p["dec"] + p["bterm"]

        def per_feature(v):
            return torch.zeros(n_out, dtype=F64).index_add_(0, f, v)

        keep = count >= 20
        share = per_feature(p["bterm"].abs()) / (per_feature(p["dec"].abs()) + per_feature(p["bterm"].abs()))
        var_b = _var(per_feature, p["bterm"], f, count)
        var_full = _var(per_feature, full, f, count)
        corr_full = _corr(per_feature, p["target"], full, f, count)
        corr_dec = _corr(per_feature, p["target"], p["dec"], f, count)
        err_full = (per_feature((p["target"] - full).square()) / per_feature(p["target"].square())).sqrt()
        err_dec = (per_feature((p["target"] - p["dec"]).square()) / per_feature(p["target"].square())).sqrt()
        med = lambda v: float(np.nanmedian(v[keep].numpy()))  # noqa: E731
        print(f"    {l:>5} {int(keep.sum()):>5} {pct(med(share)):>16} {pct(med(var_b / var_full)):>17} "
              f"{f'{med(corr_full):.3f} / {med(corr_dec):.3f}':>18} "
              f"{f'{pct(med(err_full))} / {pct(med(err_dec))}':>33}")

    print("\n3.2 Active-token threshold: ours min_active 20 (NaN below), theirs nnz > 10 (histogram) / "
          "nnz >= 10 (curve).")
    print("    Output features by active tokens in the lowrank table (n_active over its held-out rows):")
    print(f"    {'layer':>5} {'feat':>5} {'0 active':>9} {'1-9':>5} {'10':>4} {'11-19':>6} {'>= 20':>6} "
          f"{'NaN ours, corr theirs (hist / curve)':>37} {'table n_active = ours here':>27}")
    tables = {}
    for l in layers:
        lr = read_layer_table(run, "lowrank", l, part_name(RESID_MID, SAE_OUTPUTS, "encoder"), tries, wait)
        lr = lr[lr["outputs"] == SAE_OUTPUTS] if "outputs" in lr.columns else lr
        tables[l] = lr
        n = lr[lr["n_eigs"] == 1].set_index("out_feature")["n_active"].sort_index()
        same = (n.to_numpy() == n_active_ours[l].numpy()[n.index.to_numpy()]).mean() if n_rows == 1024 else float("nan")
        print(f"    {l:>5} {len(n):>5} {int((n == 0).sum()):>9} {int(((n >= 1) & (n <= 9)).sum()):>5} "
              f"{int((n == 10).sum()):>4} {int(((n >= 11) & (n <= 19)).sum()):>6} {int((n >= 20).sum()):>6} "
              f"{f'{int(((n > 10) & (n < 20)).sum())} / {int(((n >= 10) & (n < 20)).sum())}':>37} "
              f"{pct(same) if n_rows == 1024 else 'n/a (--rows != 1024)':>27}")

    print("\n3.3 BOS: theirs drop position 0 of each row (a row = one document, BOS first, right-padded);")
    print("    ours pack documents BOS-first into rows and drop every BOS, wherever it falls, and each row's first")
    print("    token (an attention sink even where it continues a document).")
    tok = np.asarray(held.tokens[:n_rows])
    bos = tok == held.bos_id
    n_bos, first = int(bos.sum()), int(bos[:, 0].sum())
    print(f"    held-out rows used: {n_rows} x {tok.shape[1]} tokens; BOS tokens {n_bos}, of them at position 0: "
          f"{first}, elsewhere: {n_bos - first} ({pct((n_bos - first) / max(n_bos, 1))} of BOS; their rule would keep "
          f"these); no padding in ours.")

    print("\n3.4 TopK: sae-lens/ours zero negative kept values (ReLU after TopK), theirs keep them "
          "(negative activations).")
    print("    Share of the k selected (token, latent) values whose pre-activation is negative, held-out tokens:")
    print(f"    {'layer':>5} {'site':>10} {'k':>3} {'negative selections':>26} {'tokens with one or more':>24} "
          f"{'smallest k-th value':>20}")
    for (l, site), (n_neg, n_sel, t_neg, t_all, low) in neg.items():
        k = (sae_in if site == RESID_MID else sae_out)[l].k
        print(f"    {l:>5} {site:>10} {k:>3} {f'{n_neg} of {n_sel} ({pct(n_neg / n_sel)})':>26} "
              f"{pct(t_neg / t_all):>24} {low:>20.3f}")

    print("\n3.5 Their 'top 2' histogram plots y_hat[..., 2] of a cumulative sum: the top 3 eigenvectors.")
    print("    Lowrank table, active-only correlation over features with a value (n_active >= 20):")
    print(f"    {'layer':>5} {'median r=2':>11} {'median r=3':>11} {'overstated by':>14} {'mean r=2':>9} "
          f"{'mean r=3':>9}")
    for l in layers:
        lr = tables[l]
        wide = lr.pivot(index="out_feature", columns="n_eigs", values="corr_active")[[2, 3]].dropna()
        m2, m3 = wide[2].median(), wide[3].median()
        print(f"    {l:>5} {m2:>11.3f} {m3:>11.3f} {m3 - m2:>+14.3f} {wide[2].mean():>9.3f} {wide[3].mean():>9.3f}")


def _pair_forms(x: torch.Tensor, mats: torch.Tensor, token: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
    """`x[token[p]]^T mats[feature[p]] x[token[p]]` for every pair p, grouped by feature."""
    out = torch.empty(token.numel(), dtype=x.dtype)
    order = torch.argsort(feature, stable=True)
    counts = torch.bincount(feature[order], minlength=mats.shape[0]).tolist()
    start = 0
    for f, count in enumerate(counts):
        if count:
            idx = order[start:start + count]
            xs = x.index_select(0, token[idx])
            out[idx] = ((xs @ mats[f]) * xs).sum(-1)
            start += count
    return out


def _var(per_feature, v: torch.Tensor, f: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Per-feature variance of the pairs' values `v` (centred on each feature's own mean)."""
    d = v - (per_feature(v) / count)[f]
    return per_feature(d.square()) / count


def _corr(per_feature, a: torch.Tensor, b: torch.Tensor, f: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Per-feature Pearson correlation of the pairs' values `a` and `b`."""
    da = a - (per_feature(a) / count)[f]
    db = b - (per_feature(b) / count)[f]
    return per_feature(da * db) / (per_feature(da.square()) * per_feature(db.square())).sqrt()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", nargs="?", default=str(REPO / "results" / "demo"),
                        help="run directory (default results/demo of this checkout)")
    parser.add_argument("--no-run", action="store_true", help="random weights and planted outliers only")
    parser.add_argument("--rows", type=int, default=1024, help="held-out rows of the token pass (default 1024, "
                        "the demo's corr_rows, so that active counts can be checked against the lowrank table)")
    parser.add_argument("--max-rank", type=int, default=8, help="largest rank of the low-rank correlations")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: fastest on busy 2-core machines)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the random-weight measurements")
    parser.add_argument("--tries", type=int, default=30, help="tries to read a table being rewritten")
    parser.add_argument("--wait", type=float, default=10.0, help="seconds between tries")
    add_output(parser, OUTPUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    print("Differences from the paper authors' code, measured (benchmarks/reference_differences.py)")
    print(f"torch {torch.__version__}, {args.threads} thread(s), float64 throughout (activations come from the "
          "float32 model)")
    seeds = list(range(args.seeds))
    random_weights_eigen([128, 512], seeds, {128: 64, 512: 16})
    outlier_positions(n=64, n_mats=200, n_cross=10, n_self=3, seed=0)
    run = Path(args.run)
    if args.no_run:
        print("\n(--no-run: the demo-run measurements 1(b), 1(c) and 3 were skipped)")
    elif not (run / "lm").is_dir() or not (run / "saes").is_dir():
        print(f"\nno demo run at {run} (need {run}/lm and {run}/saes): the demo-run measurements 1(b), 1(c) and 3 "
              f"were skipped. Run `make demo` (results/demo) or pass a run directory.")
    else:
        demo_run(run, args.rows, args.max_rank, args.tries, args.wait)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    run_recorded(main, OUTPUT)
