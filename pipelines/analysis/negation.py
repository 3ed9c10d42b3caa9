"""Where the model computes the negation: which output directions carry a cross term between
the negation inputs and the context inputs, in which layer, and how large.

On the built-in stories the word after a negation has the valence of its context flipped,
an XOR of two labels. A bilinear MLP can compute it as a cross term, negation x context
(`circuits.cross_terms`). Here every layer of a run is scanned:

- the groups are the run's label groups, formed as the verdicts form them
  (`pipelines.analysis.verdicts.InputFacts.classes`): the input features mainly on negation
  tokens, and those mainly in one context class; each (negation, context=C) pair is made
  disjoint as the group gates make it. And, without any SAE, the *probe* directions of the
  MLP input: mean on negated less on plain positions, mean in one context class less the
  other (`_probe_sides`), in case the SAE's latents split the two concepts elsewhere;
- the output directions are every output SAE feature (its encoder row: what its
  pre-activation reads), the difference of the lexicon classes' mean unembeddings through the
  final norm's gain (`logit:A-B`, the MLP's direct effect on the class logit difference), the
  layer's top HOSVD directions, and the directions with the largest cross block between the
  two groups (`best-cross`, `circuits.cross_terms.best_cross_directions`);
- the tokens are the *negated positions*: those inside a negation whose next token is a whole
  lexicon word (where `lexicon_accuracy` scores the model after a negation), in context C;
- per direction: the 2-group form's blocks and eigenvalue pair from the weights, and on those
  tokens the exact split of the output's quadratic part into each side's own terms, the cross
  term and the rest (MLP input split by the input SAE's latents of each group; the rest holds
  the other latents, `b_dec` and the SAE's error, so the split is exact on the real input).

Alongside, whatever the mechanism: the direct effect of every attention and MLP layer on the
lexicon logit difference, signed toward the class of the word that comes next, on negated and
on plain positions (which component writes the flip), and where along the residual stream the
next word's class becomes linearly readable after a negation (where the XOR is computed), with
each MLP's cross terms removed from the stream (whether it is computed by them). The result is one JSON file in the run
(`NEGATION_FILE`), printed by `pipelines.summary.negation` and shown by the report.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from circuits.bilinear import hosvd, interaction_matrices, output_constant
from circuits.cross_terms import (GroupParts, best_cross_directions, bilinear_vectors, eigen_pair, group_blocks,
                                  orthonormal_span, part_shares, split_by_groups)
from circuits.sae_basis import input_basis, token_scale
from circuits.sites import hook_name, input_gain
from circuits.weights import from_hooked_transformer
from pipelines.analysis.group_gates import _disjoint
from pipelines.analysis.verdicts import InputFacts, VerdictConfig
from pipelines.data.labels import LEXICON_CHANNEL
from pipelines.data.story_corpus import CONTEXT, NEGATION
from pipelines.data.tags import side_labels
from pipelines.data.tokens import TokenRows, TokenStore
from pipelines import schemas
from pipelines.engine.files import read_json, write_json
from pipelines.engine.paths import RunPaths
from pipelines.inputs import LayerPlan, ModelInputs

NEGATION_FILE = "negation_locus.json"  # in the run's folder


@dataclass(frozen=True)
class NegationScan:
    """How the negation locus is scanned."""

    rows: int = 512  # held-out rows read (their negated positions are the tokens)
    n_hosvd: int = 8  # top HOSVD directions per layer
    n_best: int = 2  # best cross directions per layer and pair of groups
    min_active: float = 0.1  # an SAE feature counts in the summary when active on this share of the tokens


def negated_positions(rows: TokenRows, part: slice, tokens: torch.Tensor, lexicon_tokens: dict[str, list[int]],
                      classes: dict[str, list[str]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per position of a batch of rows `[n, n_ctx]`: whether the next token is a whole word of
    the first two lexicon classes (`+1` first, `-1` second, 0 neither), whether it lies in a
    negation, and its context class code (0 none). Each `[n, n_ctx]`; the last position has no next word."""
    first, second = classes[LEXICON_CHANNEL][:2]
    nxt = np.zeros(tokens.shape, dtype=np.int64)
    following = tokens[:, 1:].numpy()
    nxt[:, :-1] = np.where(np.isin(following, lexicon_tokens.get(first, [])), 1,
                           np.where(np.isin(following, lexicon_tokens.get(second, [])), -1, 0))
    negated = np.asarray(rows.labels[NEGATION][part]) != 0
    context = np.asarray(rows.labels[CONTEXT][part]).astype(np.int64)
    return nxt, negated, context


def label_pairs(facts: InputFacts) -> list[tuple[str, str, list[int], list[int]]]:
    """(context class, group name of B, negation members, context members) of each context class
    with a label group, the two groups disjoint; empty without a negation group."""
    groups = facts.classes
    negation = [name for name in groups if NEGATION in side_labels(name)]
    if not negation:
        return []
    neg = sorted({m for name in negation for m in groups[name]})
    found = []
    for name, members in groups.items():
        for label in side_labels(name):
            if label.startswith(f"{CONTEXT}=") and name not in negation:
                a, b = _disjoint(neg, members)
                if a and b:
                    found.append((label[len(CONTEXT) + 1:], name, a, b))
    return found


@torch.no_grad()
def scan_negation(lm: ModelInputs, store: TokenStore, plans: dict[int, LayerPlan], features: pd.DataFrame | None,
                  labels: pd.DataFrame | None, rules: VerdictConfig = VerdictConfig(),
                  cfg: NegationScan = NegationScan()) -> dict:
    """The negation locus of a run's layers (see the module docstring), ready for JSON: a dict with
    `directions` (one row per layer, source of groups, context class and output direction),
    `components` (direct effects on the logit difference), `decodable` (the linear readout after
    each part), `without` (that readout after each MLP with a part of its output removed),
    `groups` (the label groups), `counts` (negated and plain positions) and `lexicon`."""
    model, rows = lm.model, store.held_out
    classes, lexicon = store.classes, store.lexicon_tokens
    missing = [c for c in (NEGATION, CONTEXT, LEXICON_CHANNEL) if c not in classes]
    if missing or len(classes[LEXICON_CHANNEL]) < 2:
        raise ValueError(f"the negation scan needs the corpus's {', '.join(missing) or 'lexicon'} labels (with two "
                         "lexicon classes): the built-in stories carry them")
    first, second = classes[LEXICON_CHANNEL][:2]
    W_U = model.W_U.detach().double().cpu()
    gain = getattr(model.ln_final, "w", None)
    logit = (W_U[:, lexicon[first]].mean(1) - W_U[:, lexicon[second]].mean(1))
    logit = logit if gain is None else gain.detach().double().cpu() * logit  # [d_model]
    n_layers = model.cfg.n_layers
    saes = {layer: plan.saes(lm) for layer, plan in plans.items()}
    names = [hook_name(layer, s.input_site) for layer, s in saes.items()]
    names += [f"blocks.{layer}.hook_mlp_out" for layer in saes]
    parts = ["blocks.0.hook_resid_pre"] + [f"blocks.{layer}.hook_{c}_out" for layer in range(n_layers)
                                           for c in ("attn", "mlp")]
    wanted = set(names) | set(parts) | {"ln_final.hook_scale"}
    kept: dict[str, list[torch.Tensor]] = {n: [] for n in wanted}
    sign, neg_at, ctx_at, row_at = [], [], [], []
    for part, tokens in rows.iter_batches(32, cfg.rows):
        nxt, negated, context = negated_positions(rows, part, tokens, lexicon, classes)
        where = torch.from_numpy((nxt != 0) & rows.keep(tokens).numpy())
        if not where.any():
            continue
        _, cache = model.run_with_cache(tokens.to(model.cfg.device), names_filter=lambda n: n in wanted)
        for n in wanted:
            kept[n].append(cache[n][where.to(cache[n].device)].double().cpu())
        sign.append(torch.from_numpy(nxt)[where])
        neg_at.append(torch.from_numpy(negated)[where])
        ctx_at.append(torch.from_numpy(context)[where])
        row_at.append(torch.arange(part.start, part.stop)[:, None].expand_as(where)[where])
    if not sign:
        raise ValueError("no held-out position is followed by a lexicon word: nothing to scan")
    acts = {n: torch.cat(v) for n, v in kept.items()}
    sign, negated, context = torch.cat(sign).double(), torch.cat(neg_at), torch.cat(ctx_at)
    components = _components(acts, parts, logit, model, lexicon, first, second, sign, negated)
    train = torch.cat(row_at) % 2 == 0
    decodable, readouts = _decodable(acts, parts, sign, negated, train)
    without = []
    to_logit = sign / acts["ln_final.hook_scale"].reshape(-1)  # a direct effect in logits, toward the next word's class
    rows_out, groups = [], []
    for layer, s in saes.items():
        facts = InputFacts.of(features, labels, layer, s.input_site, rules)
        pairs = label_pairs(facts)
        groups += [{"layer": layer, "context": c, "group_b": name, "negation": a, "members_b": b} for c, name, a, b in pairs]
        found, crosses = _layer_rows(model, layer, s, acts, pairs, classes[CONTEXT], negated, context, logit,
                                     f"logit:{first}-{second}", to_logit, cfg)
        rows_out += found
        stream, w = readouts[f"mlp {layer}"]
        removed = {"the whole MLP": acts[f"blocks.{layer}.hook_mlp_out"], **crosses}
        without += [{"layer": layer, "removed": name, **_readout(stream - v, w, sign, negated, ~train)}
                    for name, v in removed.items()]
    counts = {"negated": int(negated.sum()), "plain": int((~negated).sum())}
    return {"directions": rows_out, "components": components, "decodable": decodable, "without": without,
            "groups": groups,
            "counts": counts, "lexicon": [first, second]}


def _components(acts, parts, logit, model, lexicon, first, second, sign, negated) -> list[dict]:
    """Direct effect of each residual stream part on the lexicon logit difference, signed
    toward the next word's class, mean over negated and over plain positions; `total` is the
    whole difference with the unembedding's bias (the parts add up to it exactly)."""
    scale = acts["ln_final.hook_scale"].reshape(-1)
    b_U = model.b_U.detach().double().cpu()
    bias = float(b_U[lexicon[first]].mean() - b_U[lexicon[second]].mean())
    effects = {n: (acts[n] @ logit) / scale * sign for n in parts}
    effects["total"] = sum(effects.values()) + bias * sign
    out = []
    for n, v in effects.items():
        label = n if n == "total" else _component(n)
        out.append({"component": label, "negated": float(v[negated].mean()), "plain": float(v[~negated].mean()),
                    "negated_right": float((v[negated] > 0).double().mean()) if n == "total" else None})
    return out


def _component(hook: str) -> str:
    """`embed`, `attn L` or `mlp L` for a residual stream part's hook."""
    return "embed" if hook == "blocks.0.hook_resid_pre" else f"{hook.split('.')[2][5:-4]} {hook.split('.')[1]}"


def _decodable(acts, parts, sign, negated, train, ridge: float = 1e-3) -> tuple[list[dict], dict[str, tuple]]:
    """How well the next word's class is read linearly from the residual stream after each part
    (the embedding, then each attention and MLP layer in turn): a ridge readout of the RMS-
    normed stream, fitted on the even rows' positions and scored on the odd rows', negated and
    plain positions apart. Negated and plain positions in both context classes make the target
    an XOR of negation and context, which no readout of the two alone gets right: where the
    accuracy after a negation jumps is where the flip is computed. Also returns, per part, the
    stream after it `[t, d]` and its readout `[d + 1]`, to score changed streams (`_readout`)."""
    out, kept, stream = [], {}, 0
    for n in parts:
        stream = stream + acts[n]
        X = _features(stream)
        A = X[train]
        w = torch.linalg.solve(A.T @ A + ridge * len(A) * torch.eye(X.shape[1], dtype=X.dtype), A.T @ sign[train])
        out.append({"after": _component(n), **_readout(stream, w, sign, negated, ~train)})
        kept[_component(n)] = (stream, w)
    return out, kept


def _features(stream: torch.Tensor) -> torch.Tensor:
    """The RMS-normed stream with a constant column: `[t, d] -> [t, d + 1]`."""
    return torch.cat([stream / stream.square().mean(1, keepdim=True).sqrt(), torch.ones_like(stream[:, :1])], 1)


def _readout(stream, w, sign, negated, test) -> dict[str, float]:
    """Accuracy of readout `w` on the test positions' stream, negated and plain apart."""
    right = ((_features(stream) @ w) * sign > 0)[test]
    return {"negated": float(right[negated[test]].double().mean()), "plain": float(right[~negated[test]].double().mean())}


@dataclass
class _Sides:
    """Two input groups of one layer, for one context class: their input directions and what
    they write into the MLP input on the scanned tokens."""

    context: str  # the context class whose negated positions are read
    source: str  # "labels" (the run's label groups of input latents) or "probe" (difference of means)
    group_b: str  # the context side's name
    M_a: torch.Tensor  # [d, p] the negation side's input directions
    M_b: torch.Tensor  # [d, q] the context side's
    x_a: torch.Tensor  # [t, d]
    x_b: torch.Tensor  # [t, d]
    both_on: torch.Tensor | None  # [t] bool: a latent of each side active (label groups only)


def _layer_rows(model, layer, saes, acts, pairs, context_classes, negated, context, logit, logit_name, to_logit,
                cfg: NegationScan) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The rows of one layer's directions, and per source of groups (labels, probe) the cross
    terms' part of the MLP's output vector on every token `[t, d_model]` (the label groups' of
    both context classes together)."""
    mlp = from_hooked_transformer(model, layer).to(torch.float64, "cpu")  # where the cached activations are
    sae_in, sae_out = (s.weights.to(torch.float64, "cpu") for s in (saes.sae_in, saes.sae_out))
    gain = input_gain(saes.input_site, mlp.g)
    basis = input_basis(sae_in.W_dec, sae_in.b_dec, gain)  # [d, n_in + 1]
    r = acts[hook_name(layer, saes.input_site)]
    factor = token_scale(r, mlp.eps, saes.input_site).sqrt()[:, None]  # x = factor * gain * r
    x = factor * (r if gain is None else gain * r)
    z = sae_in.encode(r)
    active_out = sae_out.encode(acts[f"blocks.{layer}.hook_mlp_out"]) > 0  # [t, n_out]
    U_sae = sae_out.W_enc.T
    fixed = [("sae", str(f), U_sae[f]) for f in range(U_sae.shape[0])] + [("logit", logit_name, logit)]
    _, left = hosvd(mlp.W_gate, mlp.W_in, mlp.W_out, cfg.n_hosvd)
    fixed += [("hosvd", str(i), left[:, i]) for i in range(left.shape[1])]
    sides = []
    for cls, group_b, members_a, members_b in pairs:
        a, b = torch.tensor(members_a), torch.tensor(members_b)
        sides.append(_Sides(cls, "labels", group_b, basis[:, a], basis[:, b],
                            factor * _written(z[:, a], sae_in.W_dec[a], gain),
                            factor * _written(z[:, b], sae_in.W_dec[b], gain),
                            (z[:, a] > 0).any(1) & (z[:, b] > 0).any(1)))
    sides += _probe_sides(x, negated, context, context_classes)
    out, crosses = [], {}
    weights = {}  # per pair of groups, what the weights say: the same for every context class read on them
    for side in sides:
        if (side.source, side.group_b) not in weights:
            key = f"its {side.source} cross term"
            crosses[key] = crosses.get(key, 0) + 2 * bilinear_vectors(mlp.W_gate, mlp.W_in, mlp.W_out, side.x_a, side.x_b)
            weights[side.source, side.group_b] = _weight_rows(mlp, side, fixed, cfg)
        directions, unit, blocks, top, bottom = weights[side.source, side.group_b]
        p, q = side.M_a.shape[1], side.M_b.shape[1]
        # only the context class's negated positions are read: each token's parts are computed for its class alone
        where = negated & (context == context_classes.index(side.context) + 1)
        x_a, x_b, x_w, r_w = side.x_a[where], side.x_b[where], x[where], r[where]
        split = split_by_groups(mlp.W_gate, mlp.W_in, mlp.W_out, unit, x_a, x_b, x_w - x_a - x_b)
        shares = part_shares(split)
        to_r = factor[where] * (gain if gain is not None else 1.0)  # the input's parts as parts of the SAE's site
        r_a, r_b = (torch.where(to_r != 0, v / to_r, torch.zeros_like(v)) for v in (x_a, x_b))
        kept = ((r_w - r_a - r_b).square().sum(1) / r_w.square().sum(1)).mean()  # what the norm sees left
        renormed = (_renormed_cross(mlp, r_w, r_a, r_b, gain, saes.input_site) @ unit.T).mean(0) \
            / split.total.abs().mean(0)
        both_on = float(side.both_on[where].double().mean()) if side.both_on is not None and where.any() else None
        i = U_sae.shape[0]  # the logit direction follows the SAE's features
        logits = _in_logits(split, i, logit.norm() * to_logit[where],
                            float(unit[i] @ output_constant(mlp.W_out, mlp.b_in, mlp.b_out)))
        for i, (kind, name, _) in enumerate(directions):
            active = float(active_out[where, int(name)].double().mean()) if kind == "sae" and where.any() else None
            out.append({
                "layer": layer, "context": side.context, "source": side.source, "group_b": side.group_b, "n_a": p,
                "n_b": q, "kind": kind, "direction": name, "n_tokens": shares.n_tokens,
                "both_on": both_on, "active": active, "mean_output": float(shares.total[i]),
                "share_own_a": float(shares.own_a[i]), "share_own_b": float(shares.own_b[i]),
                "share_cross": float(shares.cross[i]), "share_rest": float(shares.rest[i]),
                "cross_weight": float(shares.cross_weight[i]), "w_self_a": float(blocks.self_a[i]),
                "w_self_b": float(blocks.self_b[i]), "w_cross": float(blocks.cross[i]),
                "w_cross_share": float(blocks.cross_share[i]), "lambda_pos": float(top[i]),
                "lambda_neg": float(bottom[i]), "share_cross_renormed": float(renormed[i]),
                "square_kept": float(kept),
                **(logits if kind == "logit" else {})})
    return out, crosses


def _weight_rows(mlp, side: _Sides, fixed: list[tuple], cfg: NegationScan) -> tuple:
    """What the weights say of one pair of groups: the output directions (`fixed`, then the pair's
    best cross directions) as `(kind, name, vector)` and as unit rows `[c, d_out]`, the 2-group
    form's blocks (`GroupBlocks`) and its eigenvalue pair (each `[c]`)."""
    best, _ = best_cross_directions(mlp.W_gate, mlp.W_in, mlp.W_out, side.M_a, side.M_b, cfg.n_best)
    directions = fixed + [("best-cross", str(i), best[i]) for i in range(best.shape[0])]
    U = torch.stack([d for *_, d in directions])
    unit = U / U.norm(dim=1, keepdim=True).clamp_min(1e-30)
    M = torch.cat([side.M_a, side.M_b], 1)
    p = side.M_a.shape[1]
    form = interaction_matrices(M.T @ mlp.W_gate, M.T @ mlp.W_in, mlp.W_out, unit)
    blocks = group_blocks(form, torch.arange(p), p + torch.arange(M.shape[1] - p))
    P = orthonormal_span(M)
    top, bottom = eigen_pair(interaction_matrices(P.T @ mlp.W_gate, P.T @ mlp.W_in, mlp.W_out, unit))
    return directions, unit, blocks, top, bottom


def _renormed_cross(mlp, r: torch.Tensor, r_a: torch.Tensor, r_b: torch.Tensor, gain, site: str) -> torch.Tensor:
    """The four-point interaction of removing `r_a` and `r_b` from the site's activations `r`
    (each `[t, d]`) with the norm recomputed after each removal, as the layer computes it: the
    MLP output vector (less its constant) with nothing removed, less that without a, less that
    without b, plus that without both, `[t, d_out]`. With the norm's factor frozen it is exactly
    the cross term; the recomputed norm scales up what a removal leaves, and so shrinks it."""
    def output(res: torch.Tensor) -> torch.Tensor:
        x = (res if gain is None else gain * res) * token_scale(res, mlp.eps, site).sqrt()[:, None]
        return bilinear_vectors(mlp.W_gate, mlp.W_in, mlp.W_out, x, x)

    return output(r) - output(r - r_a) - output(r - r_b) + output(r - r_a - r_b)


def _in_logits(split: GroupParts, i: int, factor: torch.Tensor, constant: float) -> dict[str, float]:
    """The logit direction's parts (direction `i` of `split`, a unit vector) as mean direct effects
    on the logit difference toward the next word's class: each token's part times `factor [t]`;
    `logit_total` adds the MLP's constant along the direction, so it is the MLP's whole direct effect."""
    found = {f"logit_{name}": float((getattr(split, name)[:, i] * factor).mean())
             for name in ("own_a", "own_b", "cross", "rest")}
    found["logit_constant"] = float((constant * factor).mean())
    found["logit_total"] = sum(found.values())
    return found


def _probe_sides(x: torch.Tensor, negated: torch.Tensor, context: torch.Tensor, classes: list[str]) -> list[_Sides]:
    """The negation and the context read from the MLP input itself, without any SAE: the
    negation direction is the mean input on negated positions less that on plain ones, the
    context direction the mean input in the first context class less that in the second
    (made orthogonal to the negation's). Each side is the input's centred projection on its
    direction, so the cross term is the product of the two centred coordinates: what an XOR of
    the two needs beyond each alone. Empty when a cell of the 2 x 2 split has no token."""
    if len(classes) < 2:
        return []
    first, second = context == 1, context == 2
    if not (negated.any() and (~negated).any() and first.any() and second.any()):
        return []
    a = x[negated].mean(0) - x[~negated].mean(0)
    a = a / a.norm()
    b = x[first].mean(0) - x[second].mean(0)
    b = b - (b @ a) * a
    b = b / b.norm()
    centred = x - x.mean(0)
    x_a, x_b = (centred @ a)[:, None] * a, (centred @ b)[:, None] * b
    return [_Sides(cls, "probe", f"{CONTEXT} probe", a[:, None], b[:, None], x_a, x_b, None) for cls in classes[:2]]


def _written(z: torch.Tensor, W_dec: torch.Tensor, gain: torch.Tensor | None) -> torch.Tensor:
    """What latents `z [t, k]` write into the MLP input before the norm's per-token factor: `[t, d]`."""
    part = z @ W_dec
    return part if gain is None else gain * part


def summarise(found: dict, min_active: float = NegationScan.min_active) -> dict:
    """The figures the summary and the report show: per layer and context class the SAE feature
    (active on at least `min_active` of the tokens) with the largest cross share, the logit
    direction and the best cross direction; and the largest cross share of any SAE feature."""
    frame = pd.DataFrame(found["directions"])
    if frame.empty:
        return {"rows": [], "largest": None}
    picked = []
    for (layer, source, cls), mine in frame.groupby(["layer", "source", "context"], sort=True):
        sae = mine[(mine["kind"] == "sae") & (mine["active"].fillna(0) >= min_active)]
        for kind, rows in (("sae", sae), ("logit", mine[mine["kind"] == "logit"]),
                           ("best-cross", mine[mine["kind"] == "best-cross"]), ("hosvd", mine[mine["kind"] == "hosvd"])):
            if len(rows):
                picked.append(rows.loc[rows["share_cross"].abs().idxmax()])
    rows = pd.DataFrame(picked)
    sae = frame[(frame["kind"] == "sae") & (frame["active"].fillna(0) >= min_active)]
    largest = sae.loc[sae["share_cross"].abs().idxmax()].to_dict() if len(sae) else None
    return {"rows": rows.to_dict("records"), "largest": largest}


def scan_run(run: RunPaths, lm: ModelInputs, store: TokenStore, plans: dict[int, LayerPlan],
             rules: VerdictConfig = VerdictConfig(), cfg: NegationScan = NegationScan()) -> dict:
    """`scan_negation` of a run's layers, with the run's feature tables; written to the run's
    `NEGATION_FILE` (atomically) and returned."""
    features, labels = (schemas.read(run.tables, name, list(plans)) for name in ("features", "feature_labels"))
    if labels is None:
        raise FileNotFoundError(f"no feature_labels table in {run.tables}: run `features` first (the negation scan "
                                "forms its groups from the features' labels)")
    found = scan_negation(lm, store, plans, features, labels, rules, cfg)
    write_json(run.root / NEGATION_FILE, found)
    return found


def read_locus(run: RunPaths) -> dict | None:
    """The run's negation locus, if it was scanned."""
    return read_json(run.root / NEGATION_FILE)


def describe_locus(found: dict, min_active: float = NegationScan.min_active) -> list[str]:
    """A scan's figures as lines of text, for the printed summary and the report."""
    first, second = found["lexicon"]
    counts = found["counts"]
    parts = {c["component"]: c for c in found["components"]}
    total = parts.pop("total")
    lines = [f"Where the negation is computed. Direct effect on the logit difference of {first} minus {second} words, "
             f"signed toward the next word's class, mean on {counts['negated']} negated / {counts['plain']} plain "
             f"positions: " + ", ".join(f"{n} {c['negated']:+.2f}/{c['plain']:+.2f}" for n, c in parts.items())
             + f"; all {total['negated']:+.2f}/{total['plain']:+.2f} (right on {total['negated_right']:.0%} of the "
             "negated positions)."]
    mlps = {n: c["negated"] for n, c in parts.items() if n.startswith("mlp")}
    attns = {n: c["negated"] for n, c in parts.items() if n.startswith("attn")}
    if mlps and attns:
        m, a = max(mlps, key=mlps.get), max(attns, key=attns.get)
        lines.append(f"  toward the flipped class after a negation, most among the MLPs: {m} ({mlps[m]:+.2f}); among "
                     f"the attention layers: {a} ({attns[a]:+.2f})")
    if found.get("decodable"):
        lines.append("  the next word's class read linearly from the residual stream after each part (a ridge readout, "
                     "accuracy on held-out rows, negated/plain): " + ", ".join(
                         f"{d['after']} {d['negated']:.0%}/{d['plain']:.0%}" for d in found["decodable"]))
    intact = {d["after"]: d for d in found.get("decodable", [])}
    for layer in sorted({w["layer"] for w in found.get("without", [])}):
        kept = intact[f"mlp {layer}"]
        lines.append(f"  that readout after mlp {layer} ({kept['negated']:.0%}/{kept['plain']:.0%}) with a part of the "
                     "stream removed: " + ", ".join(f"{w['removed']} {w['negated']:.0%}/{w['plain']:.0%}"
                                                      for w in found["without"] if w["layer"] == layer))
    figures = summarise(found, min_active)
    if not figures["rows"]:
        lines.append("  no layer has both a negation and a context label group: no cross term to measure")
        return lines
    names = {"sae": "SAE out", "logit": "", "best-cross": "best cross direction", "hosvd": "HOSVD direction"}
    heading = None
    for r in figures["rows"]:
        if heading != (r["layer"], r["source"], r["context"]):
            heading = (r["layer"], r["source"], r["context"])
            sides = (f"negation ({r['n_a']} inputs) x {r['group_b']} ({r['n_b']} inputs)" if r["source"] == "labels"
                     else "the negation x context directions of the MLP input (difference of means, centred)")
            both = f" (both groups on at {r['both_on']:.0%})" if pd.notna(r["both_on"]) else ""
            p, q = r["n_a"], r["n_b"]
            lines.append(f"  layer {r['layer']}, {sides}, {r['n_tokens']} negated positions in {r['context']} "
                         f"contexts{both}; cross term as a share of the output's quadratic part there (weights: an "
                         f"unstructured form's cross share is {2 * p * q / (p + q) ** 2:.2f}):")
        active = f" (active on {r['active']:.0%})" if r["kind"] == "sae" else ""
        lines.append(f"    {(names[r['kind']] + ' ' + r['direction']).strip()}{active}: cross {r['share_cross']:+.1%} "
                     f"(the norm recomputed: {r['share_cross_renormed']:+.1%}; own terms: negation "
                     f"{r['share_own_a']:+.1%}, context {r['share_own_b']:+.1%}; rest "
                     f"{r['share_rest']:+.1%}); weights: cross share {r['w_cross_share']:.2f}, eigenvalues "
                     f"{r['lambda_pos']:+.3f}/{r['lambda_neg']:+.3f}"
                     + (f"; in logits toward the next word: cross {r['logit_cross']:+.2f} of the MLP's "
                        f"{r['logit_total']:+.2f}" if r["kind"] == "logit" else ""))
    largest = figures["largest"]
    if largest is not None:
        lines.append(f"  largest cross term of an SAE feature active on at least {min_active:.0%} of the negated "
                     f"positions: {largest['share_cross']:+.1%} of its output (layer {largest['layer']}, out "
                     f"{largest['direction']}, {largest['context']} contexts, {largest['source']} groups)")
    return lines
