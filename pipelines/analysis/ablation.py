"""The model-run confirmation: ablate the sides of the best gate candidates inside the model.

For a candidate (output f, side A, side B) and a seeded sample of *confirmation* tokens
(`pipelines.analysis.interventions.LayerCache`: tokens the ranking never read) where both
sides are on and f is active, the MLP's input is changed and nothing else: every member's
part `z_m d_m` of the input SAE's reconstruction, for side A, side B or both, is subtracted
from resid_mid *as the MLP reads it*, before its norm, while the residual stream that bypasses
the MLP stays as it was (on mlp_in the subtraction happens after the norm). The model runs
from the layer onward, starting from the cached residual stream entering the layer, a batch
of rows for several candidates and ablations at once; each ablated row is cut after its
last sampled token, the only positions read. Measured: f's pre-activation and activation at
the layer (output SAE on the new mlp_out) and the mean next-token log-probability of f's
boosted tokens, before and after. Every sampled token of a row is ablated in one pass, so a
later token's log-probability also feels the earlier ablations through attention (its
activation, read at the layer itself, does not).

Beside each measurement, the exact layer-local intervention (`circuits.gates.interventions`)
on the same tokens: `pre_change_predicted` and `activation_local`. They are the model run's
values at the layer, to float tolerance (a test checks it).

Where f comes from on those tokens: the MLP input x splits exactly into the images of side
A's part, side B's, the other active inputs', the SAE's `b_dec` and its reconstruction error,
so `x^T Q x = sum_p img(p)^T Q x`; each part's share of the sum over the tokens is reported
(`share_a`, ..., they add up to 1).
"""

from __future__ import annotations

import pandas as pd
import torch
import torch.nn.functional as F

from circuits import forward
from circuits.bilinear import interaction_matrices
from circuits.gates.interventions import LayerIntervention, Sides, latent_lookup, side_removal
from circuits.sae_basis import token_scale
from circuits.sites import MLP_IN, MLP_OUT, RESID_MID, input_gain
from circuits.weights import MLPWeights
from pipelines.analysis.interventions import LayerCache
from pipelines.inputs import LayerSAEs

ABLATIONS = ("a", "b", "both")
PARTS = ("a", "b", "other", "bias", "error")


@torch.no_grad()
def confirm(model, cache: LayerCache, saes: LayerSAEs, mlp: MLPWeights, sides: Sides, keys: list[dict], *,
            boosted: dict[int, list[int]], max_tokens: int, seed: int, batch_rows: int = 32) -> pd.DataFrame:
    """One row per (candidate, ablation) with confirmation tokens: `keys[c]` names candidate
    c of `sides` in the table; at most `max_tokens` tokens each."""
    if not len(sides):
        return pd.DataFrame()
    entries = cache.sample(sides, True, max_tokens, seed)
    if not len(entries.cand):
        return pd.DataFrame()
    sae_in, sae_out, site = saes.sae_in.weights, saes.sae_out.weights, cache.site
    local = LayerIntervention(mlp, sae_in.W_dec, sae_out, site)
    z = cache.z.index_select(0, entries.token).to_dense()
    flat = cache.flat[entries.token]
    row, position = flat // cache.n_ctx, flat % cache.n_ctx
    out = sides.out[entries.cand]
    device = cache.source.device
    boost = {f: torch.tensor(boosted.get(f, []), dtype=torch.long, device=device) for f in out.unique().tolist()}
    measured = {"before": _measure_runs(model, cache, saes, [(r, None, None) for r in row.unique().tolist()],
                                        row, position, out, boost, batch_rows, per_entry=None)}
    latents = latent_lookup(cache.z)
    removal = lambda members: side_removal(latents(entries.token, members), members)  # noqa: E731
    removals = {"a": removal(sides.a[entries.cand]), "b": removal(sides.b[entries.cand])}
    removals["both"] = tuple(torch.cat([x, y]) for x, y in zip(removals["a"], removals["b"]))
    records = []
    for ablated, (entry, member, coef) in removals.items():
        delta = torch.zeros(len(entries.cand), cache.source.shape[1], dtype=cache.source.dtype,
                            device=device).index_add_(0, entry, coef[:, None] * sae_in.W_dec[member])
        items = sorted(set(zip(entries.cand.tolist(), row.tolist())))
        measured[ablated] = _measure_runs(model, cache, saes, [(r, c, delta) for c, r in items], row, position, out,
                                          boost, batch_rows, per_entry=entries.cand)
        pre_local, act_local = local.evaluate(cache.source, entries.token, out, entry, member, coef)
        measured[ablated]["pre_local"], measured[ablated]["act_local"] = pre_local, act_local
    forms = _form_parts(cache, entries, z, sides, sae_in, mlp, sae_out, site)
    before = measured["before"]
    for c in entries.cand.unique().tolist():
        mine = entries.cand == c
        n = int(mine.sum())
        mean = lambda t: float(t[mine].double().mean())  # noqa: E731
        shares = forms[c] / forms[c].sum()
        for ablated in ABLATIONS:
            after = measured[ablated]
            records.append({**keys[c], "ablated": ablated, "n_tokens": n,
                            "activation_before": mean(before["act"]), "activation_after": mean(after["act"]),
                            "pre_before": mean(before["pre"]), "pre_after": mean(after["pre"]),
                            "pre_change_predicted": mean(after["pre_local"] - before["pre"]),
                            "activation_local": mean(after["act_local"]),
                            "logprob_before": mean(before["logprob"]), "logprob_after": mean(after["logprob"]),
                            **{f"share_{p}": float(v) for p, v in zip(PARTS, shares)}})
    return pd.DataFrame(records)


def _measure_runs(model, cache: LayerCache, saes: LayerSAEs, items: list, row, position, out, boost, batch_rows: int,
                  per_entry) -> dict[str, torch.Tensor]:
    """f's pre-activation, activation and boosted log-probability at every sampled entry,
    from passes of the model from the layer onward: `items` are (row, candidate, delta),
    each a pass of one row with candidate's removals `delta [E, d]` at its entries in the row
    (None: a clean pass; then `per_entry` is None and every entry of the row is read)."""
    E, device = len(row), row.device
    # boosted tokens of every output, padded: ids [n_out, L] and whether each is one (none: NaN)
    n_out = int(out.max()) + 1 if len(out) else 0
    width = max([len(t) for t in boost.values()] + [1])
    boost_ids = torch.zeros(n_out, width, dtype=torch.long, device=device)
    boost_mask = torch.zeros(n_out, width, dtype=torch.float64, device=device)
    for f, ids in boost.items():
        boost_ids[f, : len(ids)], boost_mask[f, : len(ids)] = ids, 1.0
    result = {k: torch.full((E,), float("nan"), dtype=torch.float64, device=device)
              for k in ("pre", "act", "logprob")}
    read = lambda r, c: (row == r) if c is None else (row == r) & (per_entry == c)  # noqa: E731
    # a pass runs to its batch's last read position: batch items of similar length together
    items = sorted(items, key=lambda item: int(position[read(item[0], item[1])].max()))
    for start in range(0, len(items), batch_rows):
        chunk = items[start : start + batch_rows]
        # the entries each pass reads, and how far the pass must run along its row
        reads = [read(r, c) for r, c, _ in chunk]
        length = max(int(position[m].max()) + 1 for m in reads)
        resid = cache.resid_pre[[r for r, _, _ in chunk], :length]
        removal = torch.zeros(len(chunk), length, resid.shape[-1], dtype=cache.source.dtype, device=device)
        for i, ((_, _, delta), m) in enumerate(zip(chunk, reads)):
            if delta is not None:
                removal[i, position[m]] = delta[m]
        found = _run(model, cache, saes, resid, removal if any(d is not None for _, _, d in chunk) else None)
        for i, m in enumerate(reads):
            index = m.nonzero()[:, 0]
            pos = position[index]
            mlp_out = found[MLP_OUT][i, pos].to(saes.sae_out.weights.W_enc.dtype)
            f = out[index]
            rows = torch.arange(len(index), device=device)
            result["pre"][index] = saes.sae_out.weights.pre(mlp_out)[rows, f].double()
            result["act"][index] = saes.sae_out.weights.encode(mlp_out)[rows, f].double()
            logprob = F.log_softmax(forward.unembed(model, found["final"][i, pos]).double(), -1)
            ids, listed = boost_ids[f], boost_mask[f]  # [n, L]: each entry's boosted tokens
            result["logprob"][index] = (logprob.gather(1, ids) * listed).sum(-1) / listed.sum(-1)
    return result


def _run(model, cache: LayerCache, saes: LayerSAEs, resid: torch.Tensor, removal: torch.Tensor | None) -> dict:
    """resid_mid and mlp_out of the layer and the residual stream after the last block of a
    pass from the layer onward, with `removal` taken out of the MLP's input only."""
    layer, site, eps = cache.layer, cache.site, cache.eps
    gain = model.blocks[layer].ln2.w

    def change_input(resid_mid: torch.Tensor, mlp_in: torch.Tensor) -> torch.Tensor:
        changed = mlp_in - removal if site == MLP_IN else forward.rms_norm(resid_mid - removal, gain, eps)
        # only the ablated positions change: elsewhere the pass stays bit for bit the clean one
        return torch.where(removal.ne(0).any(-1, keepdim=True), changed.to(mlp_in.dtype), mlp_in)

    final, found = forward.blocks(model, resid, layer, model.cfg.n_layers, [(layer, RESID_MID), (layer, MLP_OUT)],
                                  None if removal is None else {layer: change_input})
    return {site: found[layer, site] for site in (RESID_MID, MLP_OUT)} | {"final": final}


def _form_parts(cache: LayerCache, entries, z, sides: Sides, sae_in, mlp: MLPWeights, sae_out, site: str) -> dict:
    """Per candidate `[5]`: summed `img(p)^T Q x` of the parts A, B, other inputs, b_dec and
    error (PARTS) over its entries; `img(v)` is v as the quadratic form reads it (times the
    gain and the norm's factor on resid_mid)."""
    found = {}
    for c in entries.cand.unique().tolist():
        mine = entries.cand == c
        source, zc = cache.source[entries.token[mine]], z[mine]
        root = token_scale(source.double(), cache.eps, site).sqrt()[:, None]
        gain = input_gain(site, mlp.g)
        image = lambda v: (v if gain is None else v * gain).double() * root  # noqa: E731
        Q = interaction_matrices(mlp.W_gate, mlp.W_in, mlp.W_out, sae_out.W_enc.T[int(sides.out[c])][None])[0].double()
        side = lambda members: zc[:, members[members >= 0]] @ sae_in.W_dec[members[members >= 0]]  # noqa: E731
        part_a, part_b = side(sides.a[c]), side(sides.b[c])
        reconstruction = sae_in.decode(zc)
        bias = sae_in.b_dec.expand_as(source)
        parts = [part_a, part_b, reconstruction - bias - part_a - part_b, bias, source - reconstruction]
        Qx = image(source) @ Q
        found[c] = torch.stack([(image(p) * Qx).sum() for p in parts])
    return found
