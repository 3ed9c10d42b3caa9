"""The model-run confirmation: ablate the sides of the best gate candidates inside the model.

For a candidate (output f, side A, side B) and a seeded sample of *confirmation* tokens
(`pipelines.analysis.interventions.LayerCache`: tokens the ranking never read) where both
sides are on and f is active, the MLP's input is changed and nothing else: every member's
part `z_m d_m` of the input SAE's reconstruction, for side A, side B or both, is subtracted
from resid_mid *as the MLP reads it*, before its norm, while the residual stream that bypasses
the MLP stays as it was (on mlp_in the subtraction happens after the norm). The model runs
from the layer onward, starting from the cached residual stream entering the layer: a clean
pass of each row, cut after its last sampled token (the only positions read), keeps the
later blocks' attention keys and values; an ablated (candidate, row) is the clean row up to
its first sampled token, so its pass resumes there (`circuits.forward.resume`), many at once. Measured: f's pre-activation and activation at
the layer (output SAE on the new mlp_out) and the mean next-token log-probability of f's
boosted tokens, before and after. The pre-activation less `pre_constant` (the MLP's biases
through the encoder) is the MLP's output along f's encoder direction, with no TopK: what the
layer computes, which the verdicts compare with what the SAE's activation says
(`pipelines.analysis.verdicts.confirmations`). Every sampled token of a row is ablated in one pass, so a
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
from circuits.cross_terms import part_gram
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
    latents = latent_lookup(cache.z)
    removal = lambda members: side_removal(latents(entries.token, members), members)  # noqa: E731
    removals = {"a": removal(sides.a[entries.cand]), "b": removal(sides.b[entries.cand])}
    removals["both"] = tuple(torch.cat([x, y]) for x, y in zip(removals["a"], removals["b"]))
    deltas = {ablated: torch.zeros(len(entries.cand), cache.source.shape[1], dtype=cache.source.dtype,
                                   device=device).index_add_(0, entry, coef[:, None] * sae_in.W_dec[member])
              for ablated, (entry, member, coef) in removals.items()}
    measured = _measure(model, cache, saes, row, position, entries.cand, out, boost, deltas, batch_rows)
    for ablated, (entry, member, coef) in removals.items():
        pre_local, act_local = local.evaluate(cache.source, entries.token, out, entry, member, coef)
        measured[ablated]["pre_local"], measured[ablated]["act_local"] = pre_local, act_local
    forms = _form_parts(cache, entries, z, sides, sae_in, mlp, sae_out, site)
    before, records = measured["before"], []
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
                            "pre_constant": float(local.bias[int(sides.out[c])]),
                            "pre_change_predicted": mean(after["pre_local"] - before["pre"]),
                            "activation_local": mean(after["act_local"]),
                            "logprob_before": mean(before["logprob"]), "logprob_after": mean(after["logprob"]),
                            **{f"share_{p}": float(v) for p, v in zip(PARTS, shares)}})
    return pd.DataFrame(records)


def _measure(model, cache: LayerCache, saes: LayerSAEs, row, position, cand, out, boost, deltas: dict,
             batch_rows: int) -> dict[str, dict[str, torch.Tensor]]:
    """f's pre-activation, activation and boosted log-probability `[E]` at every sampled entry
    (at `row`, `position`, of candidate `cand`, output `out`), clean ("before") and after each
    ablation of `deltas` (its removal `[E, d]` at each entry). A clean pass runs each row from
    the layer to its last entry, `batch_rows` rows at a time, keeping the later blocks'
    attention keys and values; an ablation of a (candidate, row) changes nothing before its
    first entry, so its pass resumes there (`forward.resume`), all of its entries in the row
    ablated at once."""
    E, device = len(row), row.device
    # boosted tokens of every output, padded: ids [n_out, L] and whether each is one (none: NaN)
    n_out = int(out.max()) + 1 if len(out) else 0
    width = max([len(t) for t in boost.values()] + [1])
    boost_ids = torch.zeros(n_out, width, dtype=torch.long, device=device)
    boost_mask = torch.zeros(n_out, width, dtype=torch.float64, device=device)
    for f, ids in boost.items():
        boost_ids[f, : len(ids)], boost_mask[f, : len(ids)] = ids, 1.0
    sae_out = saes.sae_out.weights
    result = {kind: {k: torch.full((E,), float("nan"), dtype=torch.float64, device=device)
                     for k in ("pre", "act", "logprob")} for kind in ("before", *deltas)}

    def read(kind: str, index: torch.Tensor, mlp_out: torch.Tensor, final: torch.Tensor) -> None:
        """Entries `index`' measures from their `mlp_out` and final stream `[n, d]`."""
        f, at = out[index], torch.arange(len(index), device=device)
        mlp_out = mlp_out.to(sae_out.W_enc.dtype)
        result[kind]["pre"][index] = sae_out.pre(mlp_out)[at, f].double()
        result[kind]["act"][index] = sae_out.encode(mlp_out)[at, f].double()
        logprob = F.log_softmax(forward.unembed(model, final).double(), -1)
        ids, listed = boost_ids[f], boost_mask[f]  # [n, L]: each entry's boosted tokens
        result[kind]["logprob"][index] = (logprob.gather(1, ids) * listed).sum(-1) / listed.sum(-1)

    layer, stop = cache.layer, model.cfg.n_layers
    rows = row.unique()
    # rows in order of their last entry: a batch's clean pass runs to its longest row's, so rows of
    # like length go together (in the demo about a third fewer positions run than in row order)
    last = torch.zeros(int(rows.max()) + 1, dtype=torch.long, device=device).scatter_reduce(0, row, position, "amax")
    rows = rows[torch.argsort(last[rows], stable=True)]
    local = torch.full((int(rows.max()) + 1,), -1, dtype=torch.long, device=device)
    for start in range(0, len(rows), batch_rows):
        chunk = rows[start : start + batch_rows]
        local[chunk] = torch.arange(len(chunk), device=device)
        mine = (local[row] >= 0).nonzero()[:, 0]  # the chunk's entries
        at, pos = local[row[mine]], position[mine]
        kept: dict = {}
        final, found = forward.blocks(model, cache.resid_pre[chunk, : int(pos.max()) + 1], layer, stop,
                                      [(layer, RESID_MID), (layer, MLP_OUT)], kept=kept)
        read("before", mine, found[layer, MLP_OUT][at, pos], final[at, pos])
        # each (candidate, row) of the chunk: its entries' span, from its first entry to its last
        item = torch.unique(cand[mine] * len(chunk) + at, return_inverse=True)[1]
        n_items = int(item.max()) + 1
        first = torch.full((n_items,), 1 << 30, device=device).scatter_reduce(0, item, pos, "amin")
        span = torch.zeros(n_items, dtype=torch.long, device=device).scatter_reduce(0, item, pos, "amax") - first + 1
        item_row = torch.zeros(n_items, dtype=torch.long, device=device).scatter_(0, item, at)
        order = torch.argsort(span)  # items of similar span together
        for begin in range(0, n_items, batch_rows * 8):
            batch = order[begin : begin + batch_rows * 8]
            slot_of = torch.full((n_items,), -1, dtype=torch.long, device=device)
            slot_of[batch] = torch.arange(len(batch), device=device)
            width = int(span[batch].max())
            offset = torch.arange(width, device=device)
            positions = torch.where(offset < span[batch, None], first[batch, None] + offset, -1)  # [B, width]
            inside = slot_of[item] >= 0
            entry, b = mine[inside], slot_of[item[inside]]
            s = position[entry] - first[batch][b]
            resid_mid = found[layer, RESID_MID][item_row[batch, None], positions.clamp_min(0)]
            past = {later: (k[item_row[batch]], v[item_row[batch]]) for later, (k, v) in kept.items()
                    if later > layer}
            for kind, delta in deltas.items():
                removal = torch.zeros_like(resid_mid)
                removal[b, s] = delta[entry].to(removal.dtype)
                stream, mlp_out = forward.resume(model, resid_mid, layer, stop, positions, past,
                                                 _mlp_input_edit(cache, model.blocks[layer].ln2.w, removal))
                read(kind, entry, mlp_out[b, s], stream[b, s])
        local[chunk] = -1
    return result


def _mlp_input_edit(cache: LayerCache, gain: torch.Tensor, removal: torch.Tensor):
    """`forward.blocks`' edit that takes `removal` out of the MLP's input only: from resid_mid
    before the norm (the norm's factor recomputed), or on mlp_in after it."""

    def change_input(resid_mid: torch.Tensor, mlp_in: torch.Tensor) -> torch.Tensor:
        changed = mlp_in - removal if cache.site == MLP_IN else forward.rms_norm(resid_mid - removal, gain, cache.eps)
        # only the ablated positions change: elsewhere the pass stays bit for bit the clean one
        return torch.where(removal.ne(0).any(-1, keepdim=True), changed.to(mlp_in.dtype), mlp_in)

    return change_input


def _form_parts(cache: LayerCache, entries, z: torch.Tensor, sides: Sides, sae_in, mlp: MLPWeights, sae_out,
                site: str) -> torch.Tensor:
    """`[C, 5]`: per candidate of `sides`, `img(p)^T Q x` of the parts A, B, other inputs, b_dec
    and error (PARTS) summed over its entries (`z [E, n_in]`: the entries' latents); `img(v)` is
    v as the quadratic form reads it (times the gain and the norm's factor on resid_mid). Each
    is a row sum of the parts' Gram matrix under f's form (`circuits.cross_terms.part_gram`)."""
    source, z = cache.source[entries.token].double(), z.double()
    sae_in, mlp = sae_in.to(torch.float64), mlp.to(torch.float64)
    side = lambda members: (z * torch.zeros_like(z).scatter_add_(1, members.clamp_min(0), (members >= 0).double())  # noqa: E731
                            ) @ sae_in.W_dec
    part_a, part_b = side(sides.a[entries.cand]), side(sides.b[entries.cand])
    reconstruction = sae_in.decode(z)
    bias = sae_in.b_dec.expand_as(source)
    parts = torch.stack([part_a, part_b, reconstruction - bias - part_a - part_b, bias, source - reconstruction], 1)
    gain = input_gain(site, mlp.g)
    image = parts * token_scale(source, cache.eps, site).sqrt()[:, None, None]
    image = image if gain is None else image * gain
    read = (mlp.W_out @ sae_out.W_enc[:, sides.out[entries.cand]].double()).T  # [E, d_mlp]: each entry's output's read
    each = part_gram(image @ mlp.W_gate, image @ mlp.W_in, read).sum(-1)  # [E, 5]
    return each.new_zeros(len(sides), len(PARTS)).index_add_(0, entries.cand, each)
