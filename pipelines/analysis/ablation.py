"""Ablate the inputs of a gate candidate inside the model and compare with the weights.

For a candidate (output f, inputs a and b) and the held-out tokens where a and b are both
active, the MLP's input is changed and nothing else: `z_a d_a` (input a's part of the input
SAE's reconstruction; b's, or both) is subtracted from resid_mid *as the MLP reads it*,
before its norm, while the residual stream that bypasses the MLP stays as it was. For an
input SAE on mlp_in the subtraction happens after the norm. Measured: f's pre-activation
and activation (output SAE on the new mlp_out) and the mean next-token log-probability of
f's boosted tokens, before and after.

Predicted from the weights: the change of f's pre-activation,
`s' y'^T Q_f y' - s y^T Q_f y`, with y the MLP-input image of the input SAE's
reconstruction (gain times `D' z'` on resid_mid), y' the same without a (or b), and s, s'
the per-token factors `1/(mean(r^2) + eps)` of the real and the ablated resid_mid (1 on
mlp_in). When the input SAE reconstructs its input exactly, predicted equals measured.
"""

from __future__ import annotations

import pandas as pd
import torch
import torch.nn.functional as F

from circuits.bilinear import interaction_matrices
from circuits.gates import quadratic_form
from circuits.layer import Outputs
from circuits.weights import MLPWeights
from pipelines.data.tokens import TokenRows

ABLATIONS = ("a", "b", "both")
COLUMNS = ["layer", "out_feature", "in_a", "in_b", "layer_rank", "ablated", "n_tokens", "activation_before",
           "activation_after", "pre_before", "pre_after", "pre_change_predicted", "logprob_before", "logprob_after"]


@torch.no_grad()
def gate_ablations(model, layer: int, saes, mlp: MLPWeights, outputs: Outputs, chosen: pd.DataFrame,
                   boosted: dict[int, list[int]], rows: TokenRows, n_rows: int, max_tokens: int = 256,
                   batch_rows: int = 32) -> pd.DataFrame:
    """One row per (candidate, ablation) for the `chosen` rows of the layer's gates table,
    on the first `max_tokens` tokens of the first `n_rows` rows where both inputs are active.
    The ablated passes run only the rows that hold such tokens."""
    if chosen.empty or outputs.sae is None:
        return pd.DataFrame(columns=COLUMNS)
    sae_in, sae_out = saes.sae_in.weights, outputs.sae
    site = saes.input_site
    gain = getattr(model.blocks[layer].ln2, "w", None)
    eps = float(model.cfg.eps)
    totals: dict[tuple, torch.Tensor] = {}
    seen: dict[tuple, int] = {}
    device = sae_in.W_dec.device
    candidates = [(int(g.out_feature), int(g.in_a), int(g.in_b), int(g.layer_rank) if pd.notna(g.layer_rank) else -1)
                  for g in chosen.itertuples(index=False)]
    Q = {f: interaction_matrices(mlp.W_gate, mlp.W_in, mlp.W_out, outputs.directions[f : f + 1].to(mlp.W_gate))[0]
         for f, _, _, _ in candidates}
    for _, tokens in rows.iter_batches(batch_rows, n_rows):
        todo = [c for c in candidates if seen.get(c, 0) < max_tokens]
        if not todo:
            break
        tokens = tokens.to(device)
        keep = rows.keep(tokens)
        clean = _run(model, layer, tokens, site, gain, eps, None)
        z = sae_in.encode(clean["input"])  # [b, pos, n_in]
        for candidate in todo:
            f, a, b, rank = candidate
            where = keep & (z[..., a] != 0) & (z[..., b] != 0)
            room = max_tokens - seen.get(candidate, 0)
            if int(where.sum()) > room:  # keep the first `room` positions, in reading order
                flat = where.reshape(-1)
                flat[flat.nonzero()[room:, 0]] = False
            if not where.any():
                continue
            seen[candidate] = seen.get(candidate, 0) + int(where.sum())
            used = where.any(-1)  # rows holding the tokens: the only ones worth a pass
            part = {key: value[used] for key, value in clean.items()}
            where_part, z_part = where[used], z[used]
            y, s = _reconstruction(part["input"][where_part], z_part[where_part], sae_in, site, mlp.g, eps)
            before = _measure(part, where_part, f, sae_out, boosted.get(f, []))
            for ablated in ABLATIONS:
                drop = [a] if ablated == "a" else [b] if ablated == "b" else [a, b]
                removal = torch.zeros_like(part["input"])
                removal[where_part] = z_part[where_part][:, drop] @ sae_in.W_dec[drop]
                after = _measure(_run(model, layer, tokens[used], site, gain, eps, removal), where_part, f, sae_out,
                                 boosted.get(f, []))
                r_abl = part["input"][where_part] - removal[where_part]
                y_abl, s_abl = _reconstruction(r_abl, None, sae_in, site, mlp.g, eps,
                                               y - _to_mlp(removal[where_part], site, mlp.g))
                predicted = s_abl * quadratic_form(Q[f], y_abl) - s * quadratic_form(Q[f], y)
                row = torch.stack([where_part.sum().double(), before["act"].sum(), after["act"].sum(),
                                   before["pre"].sum(), after["pre"].sum(), predicted.double().sum(),
                                   before["logprob"].sum(), after["logprob"].sum()])
                key = (f, a, b, rank, ablated)
                totals[key] = totals.get(key, 0) + row.cpu()
    records = []
    for (f, a, b, rank, ablated), t in totals.items():
        n = float(t[0])
        records.append({"layer": layer, "out_feature": f, "in_a": a, "in_b": b, "layer_rank": rank, "ablated": ablated,
                        "n_tokens": int(n), "activation_before": float(t[1]) / n, "activation_after": float(t[2]) / n,
                        "pre_before": float(t[3]) / n, "pre_after": float(t[4]) / n,
                        "pre_change_predicted": float(t[5]) / n, "logprob_before": float(t[6]) / n,
                        "logprob_after": float(t[7]) / n})
    return pd.DataFrame(records, columns=COLUMNS)


def _to_mlp(v: torch.Tensor, site: str, g: torch.Tensor) -> torch.Tensor:
    """A vector at the input SAE's site as it enters the quadratic form (times the gain on resid_mid)."""
    return v * g if site == "resid_mid" else v


def _reconstruction(source, z, sae_in, site: str, g, eps: float, y=None):
    """(y, s): the reconstruction in MLP-input space and the per-token factor of `source`."""
    if y is None:
        y = _to_mlp(sae_in.decode(z), site, g)
    if site == "resid_mid":
        s = 1.0 / (source.double().square().mean(-1) + eps)
    else:
        s = torch.ones(source.shape[0], dtype=torch.float64, device=source.device)
    return y, s.to(y.dtype)


def _run(model, layer: int, tokens: torch.Tensor, site: str, gain, eps: float, removal: torch.Tensor | None) -> dict:
    """Logits, the input SAE's site and mlp_out of one forward pass, with `removal` taken
    out of the MLP's input only."""
    found: dict[str, torch.Tensor] = {}

    def keep_resid(act, hook):
        found["resid_mid"] = act
        if site == "resid_mid":
            found["input"] = act

    def change_normalized(act, hook):
        if site == "mlp_in":
            found["input"] = act if gain is None else act * gain
        if removal is None:
            return act
        if site == "mlp_in":
            changed = found["input"] - removal
            changed = changed if gain is None else changed / gain
        else:
            r = found["resid_mid"] - removal
            changed = r / (r.square().mean(-1, keepdim=True) + eps).sqrt()
        # only the ablated positions change: elsewhere the pass stays bit for bit the clean one
        return torch.where(removal.ne(0).any(-1, keepdim=True), changed.to(act.dtype), act)

    def keep_out(act, hook):
        found["mlp_out"] = act

    logits = model.run_with_hooks(tokens, fwd_hooks=[
        (f"blocks.{layer}.hook_resid_mid", keep_resid),
        (f"blocks.{layer}.ln2.hook_normalized", change_normalized),
        (f"blocks.{layer}.hook_mlp_out", keep_out),
    ])
    found["logits"] = logits
    return found


def _measure(run: dict, where: torch.Tensor, f: int, sae_out, boosted: list[int]) -> dict:
    """f's pre-activation and activation, and the mean log-probability of its boosted tokens."""
    out = run["mlp_out"][where].to(sae_out.W_enc.dtype)
    pre = sae_out.pre(out)[:, f].double()
    act = sae_out.encode(out)[:, f].double()
    if boosted:
        logprob = F.log_softmax(run["logits"][where].double(), -1)[:, boosted].mean(-1)
    else:
        logprob = torch.full_like(pre, float("nan"))
    return {"pre": pre, "act": act, "logprob": logprob}
