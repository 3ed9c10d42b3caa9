"""Ablate the inputs of a gate candidate, a pair or two groups, inside the model.

For a candidate (output f, side A, side B: one input each for a pair, several for groups)
and a seeded sample of held-out tokens where A and B are both on (any member active) and f
is active, the MLP's input is changed and nothing else: every member's part `z_m d_m` of the
input SAE's reconstruction, for side A, side B or both, is subtracted from resid_mid *as the
MLP reads it*, before its norm, while the residual stream that bypasses the MLP stays as it
was. For an input SAE on mlp_in the subtraction happens after the norm. Measured: f's
pre-activation and activation (output SAE on the new mlp_out) and the mean next-token
log-probability of f's boosted tokens, before and after. Every sampled token of a row is
ablated in one pass, so a later token's log-probability also feels the earlier ablations
through attention (its activation, read at the layer itself, does not).

Predicted from the weights: the change of f's pre-activation, `s' y'^T Q_f y' - s y^T Q_f y`,
with y the MLP-input image of the input SAE's reconstruction (gain times `D' z'` on
resid_mid), y' the same without the removed parts, and s, s' the per-token factors
`1/(mean(r^2) + eps)` of the real and the ablated resid_mid (1 on mlp_in). When the input SAE
reconstructs its input exactly, predicted equals measured.

Where f comes from on those tokens: the MLP input x splits exactly into the images of side
A's part, side B's, the other active inputs', the SAE's `b_dec` and its reconstruction error,
so `x^T Q x = sum_p img(p)^T Q x`; each part's share of the sum over the tokens is reported
(`share_a`, ..., they add up to 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F

from circuits.bilinear import interaction_matrices
from circuits.gates import quadratic_form
from circuits.sae_basis import token_scale
from circuits.sites import MLP_IN, MLP_OUT, RESID_MID, hook_name, input_gain
from circuits.spectra import smallest_per_group
from circuits.weights import MLPWeights
from pipelines.data.tokens import TokenRows
from pipelines.inputs import LayerSAEs

ABLATIONS = ("a", "b", "both")
PARTS = ("a", "b", "other", "bias", "error")


@dataclass(frozen=True)
class Target:
    """One candidate to ablate: its output, its two sides, and the columns naming it."""

    out_feature: int
    members_a: tuple[int, ...]
    members_b: tuple[int, ...]
    key: tuple[tuple[str, int], ...]  # e.g. (("out_feature", 7), ("in_a", 1), ("in_b", 2))


@torch.no_grad()
def ablations(model, layer: int, saes: LayerSAEs, mlp: MLPWeights, directions: torch.Tensor, targets: list[Target], *,
              boosted: dict[int, list[int]], rows: TokenRows, n_rows: int, max_tokens: int, seed: int,
              batch_rows: int = 32) -> pd.DataFrame:
    """One row per (target, ablation) on at most `max_tokens` tokens of the first `n_rows`
    rows (a seeded sample of those where both sides are on and the output is active); the
    ablated passes run only the rows that hold such tokens. `directions [n_out, d_model]`
    read the outputs (the output SAE's encoder rows), whose activations come from
    `saes.sae_out`."""
    if not targets:
        return pd.DataFrame()
    chosen = _sample_tokens(model, layer, saes, targets, rows, n_rows, max_tokens, seed, batch_rows)
    gain = getattr(model.blocks[layer].ln2, "w", None)
    eps = float(model.cfg.eps)
    sae_in, sae_out, site = saes.sae_in.weights, saes.sae_out.weights, saes.input_site
    Q = {t.out_feature: interaction_matrices(mlp.W_gate, mlp.W_in, mlp.W_out,
                                             directions[t.out_feature : t.out_feature + 1].to(mlp.W_gate))[0]
         for t in targets}
    totals: dict[tuple[Target, str], torch.Tensor] = {}
    form: dict[Target, torch.Tensor] = {}
    n_ctx = rows.n_ctx
    wanted = torch.cat([positions // n_ctx for positions in chosen.values()]).unique() if chosen else torch.zeros(0)
    for start in range(0, len(wanted), batch_rows):
        row_ids = wanted[start : start + batch_rows]
        tokens = rows.batch(row_ids.numpy()).to(sae_in.W_dec.device)
        clean = _run(model, layer, tokens, site, gain, eps, None)
        z = sae_in.encode(clean["input"])
        for target, positions in chosen.items():
            mine = positions[torch.isin(positions // n_ctx, row_ids)]
            if not len(mine):
                continue
            where = torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)
            where[torch.searchsorted(row_ids, mine // n_ctx), mine % n_ctx] = True
            used = where.any(-1)  # rows holding the tokens: the only ones worth a pass
            part = {key: value[used] for key, value in clean.items()}
            where_part, z_part = where[used], z[used]
            source, latents = part["input"][where_part], z_part[where_part]
            f = target.out_feature
            y, s = _reconstruction(source, latents, sae_in, site, mlp.g, eps)
            before = _measure(part, where_part, f, sae_out, boosted.get(f, []))
            form[target] = form.get(target, 0) + _form_parts(source, latents, target, sae_in, site, mlp.g, eps, Q[f])
            for ablated in ABLATIONS:
                drop = list(target.members_a if ablated == "a" else target.members_b if ablated == "b"
                            else target.members_a + target.members_b)
                removal = torch.zeros_like(part["input"])
                removal[where_part] = latents[:, drop] @ sae_in.W_dec[drop]
                after = _measure(_run(model, layer, tokens[used], site, gain, eps, removal), where_part, f, sae_out,
                                 boosted.get(f, []))
                y_abl, s_abl = _reconstruction(source - removal[where_part], None, sae_in, site, mlp.g, eps,
                                               y - _to_mlp(removal[where_part], site, mlp.g))
                predicted = s_abl * quadratic_form(Q[f], y_abl) - s * quadratic_form(Q[f], y)
                row = torch.stack([where_part.sum().double(), before["act"].sum(), after["act"].sum(),
                                   before["pre"].sum(), after["pre"].sum(), predicted.double().sum(),
                                   before["logprob"].sum(), after["logprob"].sum()])
                totals[(target, ablated)] = totals.get((target, ablated), 0) + row.cpu()
    records = []
    for (target, ablated), t in totals.items():
        n = float(t[0])
        shares = form[target] / form[target].sum()
        records.append({**dict(target.key), "ablated": ablated, "n_tokens": int(n),
                        "activation_before": float(t[1]) / n, "activation_after": float(t[2]) / n,
                        "pre_before": float(t[3]) / n, "pre_after": float(t[4]) / n,
                        "pre_change_predicted": float(t[5]) / n, "logprob_before": float(t[6]) / n,
                        "logprob_after": float(t[7]) / n,
                        **{f"share_{p}": float(v) for p, v in zip(PARTS, shares)}})
    return pd.DataFrame(records)


def _sample_tokens(model, layer: int, saes: LayerSAEs, targets: list[Target], rows: TokenRows, n_rows: int,
                   max_tokens: int, seed: int, batch_rows: int) -> dict[Target, torch.Tensor]:
    """Per target, the flat positions (row * n_ctx + position) of at most `max_tokens`
    tokens where both sides are on and the output is active, a seeded random sample."""
    sae_in, sae_out, site = saes.sae_in.weights, saes.sae_out.weights, saes.input_site
    generator = torch.Generator().manual_seed(seed)
    members = {side: [torch.tensor(getattr(t, side), dtype=torch.long) for t in targets]
               for side in ("members_a", "members_b")}
    outs = torch.tensor([t.out_feature for t in targets])
    found_target, found_position, found_key = [], [], []
    for part, tokens in rows.iter_batches(batch_rows, n_rows):
        keys = torch.rand(tokens.shape, generator=generator, dtype=torch.float64)
        tokens = tokens.to(sae_in.W_dec.device)
        clean = _run(model, layer, tokens, site, getattr(model.blocks[layer].ln2, "w", None), float(model.cfg.eps),
                     None, stop=True)
        on = sae_in.encode(clean["input"]) != 0
        active = sae_out.encode(clean[MLP_OUT])[..., outs] > 0  # [b, pos, T]
        keep = rows.keep(tokens)
        flat = (torch.arange(part.start, part.stop)[:, None] * rows.n_ctx + torch.arange(rows.n_ctx))
        for i in range(len(targets)):
            where = keep & active[..., i] & on[..., members["members_a"][i]].any(-1) \
                & on[..., members["members_b"][i]].any(-1)
            where = where.cpu()
            found_target.append(torch.full((int(where.sum()),), i))
            found_position.append(flat[where])
            found_key.append(keys[where])
        if found_target:  # keep only the best keys so far: memory stays at max_tokens per target
            group, position, key = torch.cat(found_target), torch.cat(found_position), torch.cat(found_key)
            best = smallest_per_group(group, key, max_tokens)
            found_target, found_position, found_key = [group[best]], [position[best]], [key[best]]
    group, position = torch.cat(found_target), torch.cat(found_position)
    return {t: position[group == i].sort().values for i, t in enumerate(targets) if (group == i).any()}


def _to_mlp(v: torch.Tensor, site: str, g: torch.Tensor) -> torch.Tensor:
    """A vector at the input SAE's site as it enters the quadratic form (times the gain the site implies)."""
    gain = input_gain(site, g)
    return v if gain is None else v * gain


def _scale(source: torch.Tensor, site: str, eps: float) -> torch.Tensor:
    return token_scale(source.double(), eps, site)


def _reconstruction(source, z, sae_in, site: str, g, eps: float, y=None):
    """(y, s): the reconstruction in MLP-input space and the per-token factor of `source`."""
    if y is None:
        y = _to_mlp(sae_in.decode(z), site, g)
    return y, _scale(source, site, eps).to(y.dtype)


def _form_parts(source, z, target: Target, sae_in, site: str, g, eps: float, Q) -> torch.Tensor:
    """`[5]`: summed `img(p)^T Q x` of the parts A, B, other inputs, b_dec and error (PARTS)."""
    root = _scale(source, site, eps).sqrt()[:, None]
    image = lambda v: (_to_mlp(v, site, g).double() * root)  # noqa: E731
    side = lambda members: z[:, list(members)] @ sae_in.W_dec[list(members)]  # noqa: E731
    part_a, part_b = side(target.members_a), side(target.members_b)
    reconstruction = sae_in.decode(z)
    bias = sae_in.b_dec.expand_as(source)
    parts = [part_a, part_b, reconstruction - bias - part_a - part_b, bias, source - reconstruction]
    x = image(source)
    Qx = x @ Q.double()
    return torch.stack([(image(p) * Qx).sum() for p in parts]).cpu()


def _run(model, layer: int, tokens: torch.Tensor, site: str, gain, eps: float, removal: torch.Tensor | None,
         stop: bool = False) -> dict:
    """Logits (unless `stop`: the pass ends after the layer), the input SAE's site and mlp_out
    of one forward pass, with `removal` taken out of the MLP's input only."""
    found: dict[str, torch.Tensor] = {}

    def keep_resid(act, hook):
        found[RESID_MID] = act
        if site == RESID_MID:
            found["input"] = act

    def change_normalized(act, hook):
        if site == MLP_IN:
            found["input"] = act if gain is None else act * gain
        if removal is None:
            return act
        if site == MLP_IN:
            changed = found["input"] - removal
            changed = changed if gain is None else changed / gain
        else:
            r = found[RESID_MID] - removal
            changed = r / (r.square().mean(-1, keepdim=True) + eps).sqrt()
        # only the ablated positions change: elsewhere the pass stays bit for bit the clean one
        return torch.where(removal.ne(0).any(-1, keepdim=True), changed.to(act.dtype), act)

    def keep_out(act, hook):
        found[MLP_OUT] = act

    logits = model.run_with_hooks(tokens, fwd_hooks=[
        (hook_name(layer, RESID_MID), keep_resid),
        (hook_name(layer, MLP_IN), change_normalized),
        (hook_name(layer, MLP_OUT), keep_out),
    ], stop_at_layer=layer + 1 if stop else None)
    if not stop:
        found["logits"] = logits
    return found


def _measure(run: dict, where: torch.Tensor, f: int, sae_out, boosted: list[int]) -> dict:
    """f's pre-activation and activation, and the mean log-probability of its boosted tokens."""
    out = run[MLP_OUT][where].to(sae_out.W_enc.dtype)
    pre = sae_out.pre(out)[:, f].double()
    act = sae_out.encode(out)[:, f].double()
    if boosted:
        logprob = F.log_softmax(run["logits"][where].double(), -1)[:, boosted].mean(-1)
    else:
        logprob = torch.full_like(pre, float("nan"))
    return {"pre": pre, "act": act, "logprob": logprob}
