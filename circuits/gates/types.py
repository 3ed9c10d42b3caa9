"""Gate types and the causal score, read off a candidate's intervention truth table.

`circuits.gates.interventions` gives four means of output f over a candidate's tokens: `t11`
with both sides present, `t01` with side A removed, `t10` with B removed, `t00` with both
removed. Any function of two binary inputs has the closed form

    f(a, b) = c + alpha a + beta b + gamma a b,
    c = t00,  alpha = t10 - t00 (A's own term),  beta = t01 - t00 (B's own term),
    gamma = t11 - t10 - t01 + t00 (the cross term).

Read on the output's pre-activation with the norm's factor frozen, before the output SAE's
selection, `gamma` is exactly the quadratic form's cross term `2 x_A^T Q x_B`, `alpha` and
`beta` each side's own terms and `c` the constant and the rest (a test checks it). Read on
the activations, scaled by `t11`, with
`keep_a = t01 / t11`, `keep_b = t10 / t11`, `keep_ab = t00 / t11` (the share of f kept when
the side leaves), `synergy = gamma / t11 = 1 - keep_a - keep_b + keep_ab`.

The type is read first on the layer's own computation, then on the activations. The output's
pre-activation on a candidate's tokens splits exactly (`circuits.gates.interventions`,
`LayerIntervention.form_parts`; the norm's factor frozen at the clean token's) into the
constant (the biases through the output SAE's encoder), side A's own terms (its self term
`x_A^T Q x_A` and its products with the rest of the input, `b_dec` included), B's own terms,
the cross term `2 x_A^T Q x_B`, and the rest. `form_shares` scales them by the pre-activation
less its constant, T; there are no shares (NaN) where T is not positive, or is under
`LEAST_TOTAL` of the parts' sizes `|own_a| + |own_b| + |cross| + |rest|` (a sliver left by
large parts that cancel, whose shares would be huge and say nothing). The first rule that
holds (thresholds of `GateThresholds`):

- `square`: the two sides write one direction and the output squares it (a rank-one form,
  one direction squared: one concept the SAE split over two latents, or two groups that
  each write part of one direction): their 2x2 form on the self terms and the cross term is
  nearly rank one, the cross term within `square` of `2 sqrt(self_a self_b)` and of their
  sign (`square_fit` in `[square, 1 / square]`), the form raises the pre-activation by at
  least `bilinear_cross` of it (`square_share`, signed: a square that lowers the output is an
  inhibition), and each side carries at least `matter` of the direction's value
  (`square_part`: the square root of its self term over the sum of both sides'). Any two
  inputs of an output that squares one direction have a rank-one form; an input that merely
  overlaps the direction (a bystander in superposition) is not half of it. Split whatever
  the activations say;
- `and`, the bilinear AND: the cross term carries at least `bilinear_cross` of the
  pre-activation, each side's own terms add at most `bilinear_own` of it (own terms that
  lower the output leave the side no less necessary), removing either side takes at least
  `bilinear_cross` of it (`cross_share + own_a_share`, and the same for B: own terms that
  lower the output by more than the cross term raises it make the side's removal raise the
  output), the rest carries at most `1 - bilinear_cross` (what removing both sides leaves),
  and the 2x2 form on the sides is indefinite beyond the square's band (`|square_fit| > 1 /
  square`, or self terms of two signs): the paper's strong positive interaction, negligible self-interactions and
  opposite-sign eigenvalue pair, read on the tokens where the gate works. Two groups that
  each carry part of one squared direction have a large cross term too, but their form is
  semidefinite (`|square_fit| <= 1`): the square of a sum, not an AND;

then on the activations, after the output SAE's selection:

- `xor-like`: removing either side raises f (`keep_a, keep_b >= 1 + rise`): each side
  suppresses f when the other is on;
- `inhibition`: removing one side raises f (`keep >= 1 + rise` on one side);
- `and-unformed`: the activation-level AND (each side necessary to the activation, `keep_a,
  keep_b <= need`, and the activation's cross term carrying at least `cross` of f, `synergy
  >= cross`) where the form has no shares: nothing says what the layer computes;
- `threshold`, the threshold AND: the activation-level AND while the layer does not make it a
  bilinear `and` (the rule above failed on the form's shares): the sides add in the
  pre-activation, and the output SAE's TopK or bias cut-off makes each necessary. The SAE
  does the AND, the layer does not;
- `or`: each side alone suffices and f needs one of them (`keep_a, keep_b >= suffice`,
  `keep_ab <= need`): own terms of both sides, `synergy` near -1;
- `neither`: neither side matters (`keep_a, keep_b > 1 - matter`);
- `one-sided`: one side matters, the other is a bystander with it and without it (`keep > 1 -
  matter` on one side, and removing that side once the other is gone takes less than `matter`
  of f, `|min(keep_a, keep_b) - keep_ab| < matter`, the bystander's own term in units of f,
  `t01 - t00` when B is the bystander): one own term, no cross term. A side that
  barely matters beside the other but alone gives most of f is masked, not a bystander;
- `additive`: both sides matter, neither necessary nor each sufficient: own terms of both,
  their interaction in `synergy`.

Without the form's shares (`gate_types(..., form=None)`) only the activation rules apply, and
the activation-level AND is `threshold` (the API's reading of the activations alone).

Why these thresholds (`pipelines.analysis.verdicts.VerdictConfig` holds them). With negligible
own terms, removing either side of a bilinear AND takes its cross term: `bilinear_cross` =
0.5 makes each side necessary in the pre-activation by the same `need` (half) the activation
rule asks, before any cut-off. `bilinear_own` = 0.2 is the `matter` size: a side alone moves
the pre-activation less than what counts as mattering. The planted world's bilinear ANDs carry
nearly all their pre-activation in the cross term and none in own terms or the rest; its threshold AND
(two squares added) carries none in the cross term and half in each side's own terms; its
square carries half in the cross term and a quarter in each self term, exactly rank one. The
`square` tolerance 0.8 lets the magnitudes of the two latents vary apart (two independent
uniform magnitudes give a fit of about 0.96) while the paper's AND, whose self terms vanish, has a
fit far above 1 and an XOR's difference of two inputs a negative one.

`untested` marks a candidate without tokens (or with `t11 <= 0`; the verdicts stage also
marks one tested on too few tokens). The causal score,
`clip(1 - max(keep_a, keep_b), 0, 1) * clip(synergy, 0, 1)`, is high only when both sides
are necessary and the cross term carries much of f.

Each keep and the synergy is a ratio of means over the candidate's n tokens, `R = mean(y) /
mean(f)` with y a sum of the four activations (`w . v`, v = (f, f_a, f_b, f_ab)). Its standard
error, by the delta method, is `sqrt(mean(u^2) / (n - 1)) / mean(f)` with the per-token
residual `u = y - R f = (w - R e_f) . v` (mean 0 by construction), so the mean products of v
are all it needs. Ranked by its estimate, the best of many candidates is partly the luckiest
(a keep of 0.45 on 64 tokens can be 0.55 on the next 64); the *causal bound* is the causal
score with each keep raised and the synergy lowered by `z` standard errors, and
`circuits.gates.ranking` ranks every bilinear `and` first, then every sure activation-level
AND (below, a `threshold` or `and-unformed` the sample's luck does not explain), each by it.

On few tokens the error is itself a guess, and it can be 0: where removing either side takes
f to exactly 0 on each of 20 tokens (the output SAE's TopK drops it), the keeps are 0 with no
spread, and the bound is a perfect 1 that a candidate with 256 tokens keeping 1% cannot reach.
So the bound is taken with *null tokens* added to each candidate's sample (`with_null_tokens`):
`c` tokens on which no removal changes f (`v = (m, m, m, m)`, m the sample's mean of f), the
prior that a side does nothing until the data say otherwise. Each keep becomes
`(n keep + c) / (n + c)` and the synergy `n synergy / (n + c)`, and the error is 0 only where
every token keeps the whole of f; the pull fades as `c / n`, so a candidate's bound rises
with its evidence. The types and the reported keeps stay those of the sample alone.

An `and` whose keeps sit just under `need` on its sample is, among many, partly the luckiest,
and lands just over it on other tokens often enough (three of a seed-0 demo model's best
group gates kept 44%, 48% and 50% of f on their ranking tokens, 52%, 55% and 50% in the model
run on its confirmation tokens). The activation-level ANDs that rank before the other
non-bilinear candidates are the *sure* ones (`sure_and`): those whose bound's values, each
keep raised and the synergy lowered by `z` standard errors, still pass the activation-level
AND rule (`ranking_terms`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GATE_TYPES = ("and", "threshold", "and-unformed", "square", "or", "additive", "one-sided", "inhibition", "xor-like",
              "neither", "untested")
# the form's shares are read only where the pre-activation less its constant is at least this share of its parts'
# sizes (|own_a| + |own_b| + |cross| + |rest|): a total that is a sliver of large parts that cancel makes every
# share huge and says nothing about which part carries the output
LEAST_TOTAL = 0.25
# the form's parts (`LayerIntervention.form_parts`), means over a candidate's tokens: they add up to the
# pre-activation less its constant
FORM_PARTS = ("self_a", "self_b", "own_a", "own_b", "cross", "rest")


@dataclass(frozen=True)
class GateThresholds:
    """The type rule's thresholds (module docstring)."""

    need: float  # a side is necessary when removing it keeps at most this share of f
    cross: float  # an activation-level and's cross term carries at least this share of f (its synergy)
    suffice: float  # a side alone suffices when removing the other keeps at least this share
    matter: float  # a side matters when removing it takes away at least this share
    rise: float  # removing a side inhibits when f rises by at least this share
    bilinear_cross: float = 0.5  # a bilinear and's cross term, and removing either side, take at least this share
    bilinear_own: float = 0.2  # ... and each side's own terms add at most this share
    square: float = 0.8  # a square's cross term is within this factor of 2 sqrt(self_a self_b) (the self terms)


def form_shares(pre_none, constant, parts: dict) -> dict[str, np.ndarray]:
    """`cross_share`, `own_a_share`, `own_b_share`, `rest_share` (the form's parts over the
    pre-activation less its constant, `pre_none - constant`), `square_share` (the 2x2 form on
    the sides, `self_a + self_b + cross`, over the same), `square_fit` (`cross / (2
    sqrt(self_a self_b))` signed by the self terms; NaN unless both have one sign) and
    `square_part` (the smaller side's part of the direction a square reads, `sqrt|self|` of
    it over the sum of both sides'), each `[n]`,
    from `pre_none, constant [n]` and `parts` (`FORM_PARTS`, each `[n]`). NaN where the
    pre-activation less its constant is not positive (no share of nothing) or under
    `LEAST_TOTAL` of its parts' sizes."""
    total = np.asarray(pre_none, dtype=float) - np.asarray(constant, dtype=float)
    part = {k: np.asarray(parts[k], dtype=float) for k in FORM_PARTS}
    size = sum(np.abs(part[k]) for k in ("own_a", "own_b", "cross", "rest"))
    scale = np.where((total > 0) & (total >= LEAST_TOTAL * size), total, np.nan)
    same = part["self_a"] * part["self_b"] > 0
    root = np.sign(part["self_a"]) * np.sqrt(np.where(same, part["self_a"] * part["self_b"], np.nan))
    along = np.sqrt(np.abs(np.stack([part["self_a"], part["self_b"]])))  # each side's value along the direction
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"cross_share": part["cross"] / scale, "own_a_share": part["own_a"] / scale,
                "own_b_share": part["own_b"] / scale, "rest_share": part["rest"] / scale,
                "square_share": (part["self_a"] + part["self_b"] + part["cross"]) / scale,
                "square_fit": part["cross"] / (2 * root), "square_part": along.min(0) / along.sum(0)}


def layer_shares(pre_none, pre_a, pre_b, pre_ab, constant) -> dict[str, np.ndarray]:
    """The closed form of the pre-activation as the layer computes it (the norm's factor
    recomputed with each removal): `layer_cross_share`, `layer_own_a_share`,
    `layer_own_b_share`, `layer_rest_share`, over `pre_none - constant` (NaN where not
    positive), each `[n]`. They add up to 1; only the frozen form's parts are the quadratic
    form's own terms (`form_shares`)."""
    c = np.asarray(constant, dtype=float)
    t11, t01, t10, t00 = (np.asarray(t, dtype=float) - c for t in (pre_none, pre_a, pre_b, pre_ab))
    form = closed_form(t11, t10, t01, t00)
    scale = np.where(t11 > 0, t11, np.nan)
    return {"layer_cross_share": form["cross"] / scale, "layer_own_a_share": form["own_a"] / scale,
            "layer_own_b_share": form["own_b"] / scale, "layer_rest_share": form["constant"] / scale}


def closed_form(t11, t10, t01, t00) -> dict[str, np.ndarray]:
    """The constant, own terms and cross term of a two-input truth table (module docstring)."""
    t11, t10, t01, t00 = (np.asarray(t, dtype=float) for t in (t11, t10, t01, t00))
    return {"constant": t00, "own_a": t10 - t00, "own_b": t01 - t00, "cross": t11 - t10 - t01 + t00}


def keeps(t11, t10, t01, t00) -> dict[str, np.ndarray]:
    """`keep_a, keep_b, keep_ab, synergy` (module docstring); NaN where `t11 <= 0` or unknown."""
    t11 = np.asarray(t11, dtype=float)
    usable = np.isfinite(t11) & (t11 > 0)
    scale = np.where(usable, t11, np.nan)
    keep = {"keep_a": np.asarray(t01, dtype=float) / scale, "keep_b": np.asarray(t10, dtype=float) / scale,
            "keep_ab": np.asarray(t00, dtype=float) / scale}
    keep["synergy"] = closed_form(t11, t10, t01, t00)["cross"] / scale
    return keep


def gate_types(keep_a, keep_b, keep_ab, limits: GateThresholds, form: dict | None = None) -> np.ndarray:
    """The type of each candidate (module docstring) from `keep_a, keep_b, keep_ab [n]` and
    the form's shares `form` (`form_shares`; None: the activation rules alone)."""
    a, b, ab = (np.asarray(k, dtype=float) for k in (keep_a, keep_b, keep_ab))
    low, high = np.minimum(a, b), np.maximum(a, b)
    matters = lambda k: k <= 1 - limits.matter  # noqa: E731
    layer = []
    if form is not None:
        f = {k: np.asarray(v, dtype=float) for k, v in form.items()}
        with np.errstate(invalid="ignore"):  # NaN shares satisfy no rule
            # a square that raises the output (a negative square_share) is an inhibition, not one concept
            square = ((f["square_fit"] >= limits.square) & (f["square_fit"] <= 1 / limits.square)
                      & (f["square_share"] >= limits.bilinear_cross) & (f["square_part"] >= limits.matter))
            # indefinite: an opposite-sign eigenvalue pair on the sides (|fit| > 1, or self terms of two signs)
            indefinite = ~(np.abs(f["square_fit"]) <= 1 / limits.square)
            # removing a side takes its cross term and its own terms; the rest is what removing both leaves
            takes = ((f["cross_share"] + f["own_a_share"] >= limits.bilinear_cross)
                     & (f["cross_share"] + f["own_b_share"] >= limits.bilinear_cross)
                     & (f["rest_share"] <= 1 - limits.bilinear_cross))
            bilinear = ((f["cross_share"] >= limits.bilinear_cross) & (f["own_a_share"] <= limits.bilinear_own)
                        & (f["own_b_share"] <= limits.bilinear_own) & takes & indefinite)
        unformed = ~np.isfinite(f["cross_share"])
        layer = [(square, "square"), (bilinear, "and")]
    else:
        unformed = np.zeros(a.shape, dtype=bool)
    activation_and = (high <= limits.need) & (a + b - ab <= 1 - limits.cross)
    rules = [
        (~np.isfinite(a) | ~np.isfinite(b) | ~np.isfinite(ab), "untested"),
        *layer,
        (low >= 1 + limits.rise, "xor-like"),
        (high >= 1 + limits.rise, "inhibition"),
        (activation_and & unformed, "and-unformed"),
        (activation_and, "threshold"),
        ((low >= limits.suffice) & (ab <= limits.need), "or"),
        (~matters(low), "neither"),
        (~matters(high) & (np.abs(low - ab) < limits.matter), "one-sided"),
    ]
    result = np.full(a.shape, "additive", dtype=object)
    decided = np.zeros(a.shape, dtype=bool)
    for holds, name in rules:
        result[holds & ~decided] = name
        decided |= holds
    return result


def causal_score(keep_a, keep_b, synergy) -> np.ndarray:
    """`clip(1 - max(keep_a, keep_b), 0, 1) * clip(synergy, 0, 1)`; NaN where untested."""
    need = np.clip(1 - np.maximum(np.asarray(keep_a, dtype=float), np.asarray(keep_b, dtype=float)), 0, 1)
    return need * np.clip(np.asarray(synergy, dtype=float), 0, 1)


# the weights of each ratio's numerator over v = (f, f_a, f_b, f_ab) (`REMOVALS` order)
_NUMERATORS = {"keep_a": (0, 1, 0, 0), "keep_b": (0, 0, 1, 0), "keep_ab": (0, 0, 0, 1), "synergy": (1, -1, -1, 1)}


def keep_errors(n, mean, second) -> dict[str, np.ndarray]:
    """Standard errors `[C]` of `keep_a, keep_b, keep_ab, synergy` (module docstring) from each
    candidate's token count `n [C]`, the means of v = (f, f_a, f_b, f_ab) `mean [C, 4]` and
    their mean products `second [C, 4, 4]`; NaN where `n < 2` or `mean(f) <= 0`."""
    n, mean, second = np.asarray(n, dtype=float), np.asarray(mean, dtype=float), np.asarray(second, dtype=float)
    f = mean[:, 0]
    usable = (n >= 2) & np.isfinite(f) & (f > 0)
    scale = np.where(usable, f, np.nan)
    errors = {}
    for name, weights in _NUMERATORS.items():
        c = np.broadcast_to(np.asarray(weights, dtype=float), mean.shape).copy()
        c[:, 0] -= (mean @ np.asarray(weights, dtype=float)) / scale  # w - R e_f
        residual = np.einsum("ci,cij,cj->c", c, second, c).clip(min=0)  # mean(u^2); rounding can dip below 0
        errors[name] = np.sqrt(residual / np.where(usable, n - 1, np.nan)) / scale
    return errors


def with_null_tokens(n, mean, second, count: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(n, mean, second)` as `keep_errors` reads them (`[C]`, `[C, 4]`, `[C, 4, 4]`) with
    `count` null tokens added to each candidate's sample (module docstring): tokens where every
    removal keeps f at the sample's mean, `v = (m, m, m, m)`."""
    n, mean, second = np.asarray(n, dtype=float), np.asarray(mean, dtype=float), np.asarray(second, dtype=float)
    null = np.repeat(mean[:, :1], mean.shape[1], axis=1)
    total = n + count
    with np.errstate(invalid="ignore", divide="ignore"):  # a candidate without tokens stays NaN
        mean = (n[:, None] * mean + count * null) / total[:, None]
        second = (n[:, None, None] * second + count * null[:, :, None] * null[:, None, :]) / total[:, None, None]
    return total, mean, second


def ranking_terms(n, mean, second, z: float, null_tokens: float, limits: GateThresholds) -> dict[str, np.ndarray]:
    """What ranks candidates (module docstring), from their token statistics as `keep_errors`
    reads them with `null_tokens` added (`with_null_tokens`), each `[C]`: `causal_bound`, and
    `sure_and`, where the `and` rule holds with each keep raised and the synergy lowered by `z`
    standard errors (every side necessary and the cross term carrying `cross` beyond the
    sample's luck)."""
    n, mean, second = with_null_tokens(n, mean, second, null_tokens)
    keep = keeps(mean[:, 0], mean[:, 2], mean[:, 1], mean[:, 3])  # v is (f, f_a, f_b, f_ab): t10 is f_b
    errors = keep_errors(n, mean, second)
    # the and rule of `gate_types` (each side necessary, synergy >= cross) on the bound's values
    high = {name: keep[name] + z * errors[name] for name in ("keep_a", "keep_b")}
    with np.errstate(invalid="ignore"):  # NaN (untested) is never sure
        sure = ((np.maximum(high["keep_a"], high["keep_b"]) <= limits.need)
                & (keep["synergy"] - z * errors["synergy"] >= limits.cross))
    return {"causal_bound": causal_bound(keep, errors, z), "sure_and": sure}


def causal_bound(keep: dict, errors: dict, z: float) -> np.ndarray:
    """The causal score with `keep_a`, `keep_b` raised and `synergy` lowered by `z` of their
    standard errors (`keep_errors`; module docstring): `[n]`, NaN where untested, and where
    a candidate has no error (one token) unless `z` is 0."""
    if z == 0:
        return causal_score(keep["keep_a"], keep["keep_b"], keep["synergy"])
    return causal_score(np.asarray(keep["keep_a"]) + z * np.asarray(errors["keep_a"]),
                        np.asarray(keep["keep_b"]) + z * np.asarray(errors["keep_b"]),
                        np.asarray(keep["synergy"]) - z * np.asarray(errors["synergy"]))
