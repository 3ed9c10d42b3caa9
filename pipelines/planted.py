"""A planted-circuit world: a one-layer bilinear LM whose gates, and the input groups they
join, are known, for scoring what the toolkit finds (`benchmarks/bench_planted_circuits.py`
and `tests/test_planted_benchmark.py`).

Every token id carries a fixed sparse code over `n_inputs` input features, written into its
embedding along random unit directions (`n_inputs > d_model`: superposition); attention is
switched off (`W_O = 0`), so resid_mid is the token's embedding, and the MLP reads it
through its RMS norm (the per-token factor the toolkit accounts for). The MLP holds one
hidden unit per planted output (two for an OR):

- AND between groups: `(sum_{a in A} d_a . x) (sum_{b in B} d_b . x)`; A's members are
  alternatives (one cue of several), B's come together or alone (features of one context);
- AND between two single inputs: `(d_a . x) (d_b . x)`;
- OR: `(d_a . x)^2 + (d_b . x)^2 - (d_a . x)(d_b . x)`, either input suffices (for equal
  values, one input alone gives what both give);
- XOR: `((d_a - d_b) . x)^2`, one input without the other;
- additive: `(d_a . x)^2 + (d_b . x)^2` of two inputs that nearly always occur together (so
  correlational statistics see an AND), their directions orthogonal (an overlap would make a
  cross term of its own);
- one-sided: `(d_a . x)^2` with a bystander b that nearly always occurs with a;
- inhibition: `(d_a . x)((d_a - 0.6 d_b) . x)`, b lowers what a gives;
- split concepts: one concept written as two latents with near-parallel directions, nearly
  always active together on one frequent token, read as `((d_a + d_b) . x)^2`;
- a threshold AND: `(d_a . x)^2 + (d_b . x)^2` of two independent inputs (orthogonal
  directions, as the additive output's, each at one value), read by the output
  SAE with a bias that one input alone rarely passes (`THRESHOLD_CUT`): each input necessary
  only through the SAE's cut-off, while the layer adds them (`threshold`, not `and`);
- a square: one direction v written as two latents with the same decoder direction, always
  on together, each carrying half of v's value, read as `(v . x)^2` behind a cut-off that a
  quarter of it rarely passes (`SQUARE_CUT`): removing either latent drops the output, so
  the activations alone call it an AND, yet the 2x2 form on the two latents is rank one
  (`square`);

plus distractor inputs active at random, in superposition with all the rest, and distractor
outputs: each the square of one distractor input read along the part of its direction that
no planted input writes to. Read along the whole direction, the square would also hold a
cross term with every planted input that overlaps it, and in the seed-0 world one distractor
output was an AND with four planted inputs that the model computes (an answer the world did
not declare). The input SAE is the planted dictionary
(its encoder the decoder's transpose, but for the two latents of a split concept, which tell
each other apart as a trained SAE's would, and the square's two, which share their direction's
value; a threshold and a top-k, its values scaled past the threshold so that a latent is its
input's value on average); the output SAE reads each output along its own direction, past a
small bias (the threshold AND's and the square's: their cut-offs). Label channels mark the tokens where each group AND's cues
(`cue1`, ...) and context (`context1`, ...) are present, so label groups can be formed too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from tokenizers import Tokenizer, models

from circuits.config import Config, option, seed_option
from circuits.sites import MLP_OUT, RESID_MID
from circuits.weights import SAEWeights
from pipelines.analysis.verdicts import CIRCUIT_SIDES
from pipelines.data.tokens import TokenRows
from pipelines.inputs import LayerSAEs
from pipelines.lm.model import ModelConfig, build_model
from sae.io import LoadedSAE


@dataclass(frozen=True)
class PlantedConfig(Config):
    """The planted world's size."""

    d_model: int = option(64, "residual width", low=16)
    n_inputs: int = option(96, "input features (more than d_model: superposition)", low=24)
    vocab: int = option(1024, "token ids, each with a fixed code", low=64)
    n_ctx: int = option(32, "tokens per row", low=4)
    rows: int = option(512, "rows of tokens", low=8)
    distractor_outputs: int = option(6, "outputs that square a single distractor input", low=0)
    p_distractor: float = option(0.05, "chance a distractor input is active on a token", low=0.0, high=1.0)
    seed: int = seed_option("seeds the dictionary, the codes and the tokens")


@dataclass(frozen=True)
class Gate:
    """A planted output: what it computes from which inputs."""

    name: str
    kind: str  # and | or | xor | additive | one-sided | inhibition | split | threshold | square | distractor
    output: int
    side_a: tuple[int, ...]
    side_b: tuple[int, ...]

    @property
    def is_and(self) -> bool:
        return self.kind == "and"

    @property
    def expected_types(self) -> tuple[str, ...]:
        """The `gate_type`s (`circuits.gates.types`) right for this output: a split concept's two
        latents are a square, or anything else but an and."""
        return EXPECTED_TYPES[self.kind]


@dataclass
class PlantedWorld:
    model: object  # a HookedTransformer
    saes: LayerSAEs
    rows: TokenRows
    tokenizer: Tokenizer
    classes: dict[str, list[str]]
    gates: list[Gate]


# the planted structure: (name, kind, size of side a, size of side b)
STRUCTURE = [("group AND 1", "and", 3, 3), ("group AND 2", "and", 2, 4), ("pair AND 1", "and", 1, 1),
             ("pair AND 2", "and", 1, 1), ("OR", "or", 1, 1), ("XOR", "xor", 1, 1), ("split 1", "split", 1, 1),
             ("split 2", "split", 1, 1), ("additive", "additive", 1, 1), ("one-sided", "one-sided", 1, 1),
             ("inhibition", "inhibition", 1, 1), ("threshold AND", "threshold", 1, 1), ("square", "square", 1, 1)]
EXPECTED_TYPES = {"and": ("and",), "or": ("or",), "xor": ("xor-like", "inhibition"), "additive": ("additive",),
                  "one-sided": ("one-sided",), "inhibition": ("inhibition",),
                  "split": ("square", "or", "additive", "one-sided", "neither"), "threshold": ("threshold",),
                  "square": ("square",), "distractor": ("one-sided", "neither")}
TOGETHER = 0.95  # how often an additive output's two inputs, and a one-sided output's bystander, come together
SPLIT_TOKENS = 3  # per split concept: its frequent token (both latents), and one rare token per latent
MIN_ALONE = 0.3  # the least part of a distractor's direction that no planted input writes to (a weaker square is noise)
# the output SAE's cut-offs, as shares of the output's median pre-activation where both inputs are on: one input
# of the threshold AND gives about half of it, one latent of the square about a quarter
THRESHOLD_CUT, SQUARE_CUT = 0.8, 0.4
VALUES = (0.6, 1.2)  # an active input's value, uniform
FIRE = 0.25  # an input latent fires where it reads more than this
UNSHRINK = np.mean(VALUES) / (np.mean(VALUES) - FIRE)  # the input SAE's scale past its threshold


def build_world(cfg: PlantedConfig) -> PlantedWorld:
    gen = torch.Generator().manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    d, n_in = cfg.d_model, cfg.n_inputs
    gates, next_input = [], 0
    for output, (name, kind, n_a, n_b) in enumerate(STRUCTURE):
        side_a = tuple(range(next_input, next_input + n_a))
        side_b = tuple(range(next_input + n_a, next_input + n_a + n_b))
        next_input += n_a + n_b
        gates.append(Gate(name, kind, output, side_a, side_b))
    distractors = list(range(next_input, n_in))
    if len(distractors) < cfg.distractor_outputs:
        raise ValueError(f"{n_in} inputs leave too few distractors for {cfg.distractor_outputs} distractor outputs")
    for i in range(cfg.distractor_outputs):
        gates.append(Gate(f"distractor {i + 1}", "distractor", len(STRUCTURE) + i, (distractors[i],), ()))

    # the dictionary: random unit directions; the two latents of a split concept near-parallel,
    # in a plane of their own (as a trained SAE gives a frequent concept room)
    D = torch.randn(n_in, d, generator=gen, dtype=torch.float64)
    concepts = [(g.side_a[0], g.side_b[0]) for g in gates if g.kind == "split"]
    planes = torch.linalg.qr(torch.randn(d, 2 * len(concepts), generator=gen, dtype=torch.float64))[0]
    rest = [i for i in range(n_in) if all(i not in pair for pair in concepts)]
    D[rest] -= (D[rest] @ planes) @ planes.T
    for i, (a, b) in enumerate(concepts):
        D[a], D[b] = planes[:, 2 * i], 0.8 * planes[:, 2 * i] + 0.6 * planes[:, 2 * i + 1]
    D = D / D.norm(dim=1, keepdim=True)
    for g in gates:
        a, b = g.side_a[0], (g.side_b or (None,))[0]
        if g.kind == "square":  # one direction, two latents
            D[b] = D[a]
        elif g.kind in ("additive", "threshold"):  # two directions that add, with no overlap to make a cross term
            D[b] = D[b] - (D[b] @ D[a]) * D[a]
            D[b] = D[b] / D[b].norm()

    codes = _codes(cfg, gates, distractors, rng)  # [vocab, n_in]
    embed = torch.from_numpy(codes) @ D

    n_out = len(gates)
    planted_basis = torch.linalg.qr(D[:next_input].T)[0]  # [d, planted inputs]: where the planted inputs write
    U = torch.linalg.qr(torch.randn(d, n_out, generator=gen, dtype=torch.float64))[0].T  # [n_out, d] orthonormal
    units = []  # (output, gate direction, in direction): each hidden unit adds (gate . x)(in . x) to its output
    for g in gates:
        read = lambda side: D[list(side)].sum(0)  # noqa: E731
        da, db = read(g.side_a), read(g.side_b) if g.side_b else None
        if g.kind == "and":
            units.append((g.output, da, db))
        elif g.kind == "xor":
            units.append((g.output, da - db, da - db))
        elif g.kind == "or":
            units += [(g.output, da, da), (g.output, db, db), (g.output, da, -db)]
        elif g.kind in ("additive", "threshold"):
            units += [(g.output, da, da), (g.output, db, db)]
        elif g.kind == "square":  # both latents write the same direction: the square of it
            units.append((g.output, da, da))
        elif g.kind == "one-sided":
            units.append((g.output, da, da))
        elif g.kind == "inhibition":
            units.append((g.output, da, da - 0.6 * db))
        elif g.kind == "distractor":  # its input along what no planted input writes: a square, no AND with them
            mine = D[g.side_a[0]]
            alone = mine - planted_basis @ (planted_basis.T @ mine)  # about 0.75 long at the defaults
            if alone.norm() < MIN_ALONE:
                raise ValueError(f"PlantedConfig.d_model {d} leaves {g.name} {float(alone.norm()):.2f} of its "
                                 f"direction beside the {next_input} planted inputs (at least {MIN_ALONE}): "
                                 f"raise d_model")
            units.append((g.output, alone, alone))
        else:  # a split concept: the square of what it reads
            both = read(g.side_a + g.side_b)
            units.append((g.output, both, both))
    outputs, gate_gate, gate_in = (list(column) for column in zip(*units))
    model = build_model(ModelConfig(n_layers=1, d_model=d, n_heads=2, d_mlp=len(outputs), n_ctx=cfg.n_ctx,
                                    d_vocab=cfg.vocab, seed=cfg.seed), seed=cfg.seed).eval()
    with torch.no_grad():
        state = model.state_dict()
        state["embed.W_E"] = embed.float()
        state["blocks.0.attn.W_O"] = torch.zeros_like(state["blocks.0.attn.W_O"])
        state["blocks.0.attn.b_O"] = torch.zeros_like(state["blocks.0.attn.b_O"])
        state["blocks.0.mlp.W_gate"] = torch.stack(gate_gate, 1).float()
        state["blocks.0.mlp.W_in"] = torch.stack(gate_in, 1).float()
        state["blocks.0.mlp.W_out"] = U[outputs].float()
        state["blocks.0.mlp.b_in"] = torch.zeros(len(outputs))
        state["blocks.0.mlp.b_out"] = torch.zeros(d)
        model.load_state_dict(state)

    max_active = int((codes != 0).sum(1).max())
    encoder, b_in = D.clone(), torch.full((n_in,), -FIRE)
    for g in gates:  # a split concept's two latents tell each other apart, as a trained SAE's would
        if g.kind == "split":
            pair = [g.side_a[0], g.side_b[0]]
            encoder[pair] = torch.linalg.pinv(D[pair]).T
        if g.kind == "square":  # the two latents share the value, and the threshold, of their one direction
            pair = [g.side_a[0], g.side_b[0]]
            encoder[pair], b_in[pair] = D[pair] / 2, -FIRE / 2
    # the values past the threshold, scaled so that a latent is its input's value on average (a trained SAE's is
    # not shrunk by its threshold; shrunk, part of each input stays in the SAE's error, and the pre-activation's
    # split counts its product with the input as the input's own term)
    sae_in = SAEWeights(W_enc=(encoder.T * UNSHRINK).float().contiguous(), b_enc=b_in * UNSHRINK, W_dec=D.float(),
                        b_dec=torch.zeros(d), k=max_active)
    b_out = torch.full((n_out,), -0.05)
    for g in gates:
        if g.kind in ("threshold", "square"):
            b_out[g.output] = -_cut(g, codes, embed, gate_gate, gate_in, outputs)
    sae_out = SAEWeights(W_enc=U.T.float().contiguous(), b_enc=b_out, W_dec=U.float(), b_dec=torch.zeros(d))
    saes = LayerSAEs(0, LoadedSAE(sae_in, None, "planted", (0, RESID_MID)), RESID_MID,
                     LoadedSAE(sae_out, None, "planted", (0, MLP_OUT)))
    tokens = _tokens(cfg, gates, rng)
    labels = _labels(tokens, codes, gates)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab)}, unk_token="t0"))
    rows = TokenRows(tokens, np.arange(cfg.rows), labels, None)
    return PlantedWorld(model, saes, rows, tokenizer, {c: [c] for c in labels}, gates)


def _cut(gate: Gate, codes: np.ndarray, embed: torch.Tensor, gate_w: list, in_w: list, outputs: list) -> float:
    """The output SAE's cut-off of a threshold AND or a square (`THRESHOLD_CUT`, `SQUARE_CUT`):
    that share of the output's median pre-activation over the token ids with both inputs on
    (the MLP input is the embedding through the norm, without a gain)."""
    both = np.flatnonzero((codes[:, list(gate.side_a + gate.side_b)] != 0).all(1))
    x = embed[both] / embed[both].square().mean(1, keepdim=True).sqrt()
    units = [u for u, o in enumerate(outputs) if o == gate.output]
    pre = sum((x @ gate_w[u]) * (x @ in_w[u]) for u in units)
    return float(pre.median()) * (THRESHOLD_CUT if gate.kind == "threshold" else SQUARE_CUT)


def _codes(cfg: PlantedConfig, gates: list[Gate], distractors: list[int], rng) -> np.ndarray:
    """The code of every token id `[vocab, n_inputs]`: which inputs it carries, how strongly."""
    codes = np.zeros((cfg.vocab, cfg.n_inputs))
    value = lambda n: rng.uniform(*VALUES, n)  # noqa: E731
    split_token = _split_tokens(gates)
    for t in range(cfg.vocab):
        if t in split_token:
            g, which = split_token[t]
            a, b = g.side_a[0], g.side_b[0]
            codes[t, [a, b] if which == 0 else [a] if which == 1 else [b]] = value(2 if which == 0 else 1)
            continue
        for g in gates:
            if g.kind == "and" and len(g.side_a) > 1:  # cues: at most one of them; a context: some of its features
                if rng.random() < 0.3:
                    codes[t, rng.choice(g.side_a)] = value(1)[0]
                if rng.random() < 0.35:
                    members = [m for m in g.side_b if rng.random() < 0.6] or [rng.choice(g.side_b)]
                    codes[t, members] = value(len(members))
            elif g.kind == "square":  # one value, half on each latent
                if rng.random() < 0.35:
                    codes[t, list(g.side_a + g.side_b)] = value(1)[0] / 2
            elif g.kind in ("and", "or", "xor", "inhibition", "threshold"):
                for m in g.side_a + g.side_b:
                    if rng.random() < 0.35:
                        # the threshold AND's inputs at one value: one alone then stays under the cut-off
                        codes[t, m] = value(1)[0] if g.kind != "threshold" else np.mean(VALUES)
            elif g.kind in ("additive", "one-sided"):  # b nearly always with a (and, for additive, a with b)
                a, b = g.side_a[0], g.side_b[0]
                if rng.random() < 0.35:
                    alone = rng.random() > TOGETHER
                    pick = [a, b] if not alone else [a] if g.kind == "one-sided" or rng.random() < 0.5 else [b]
                    codes[t, pick] = value(len(pick))
        on = [m for m in distractors if rng.random() < cfg.p_distractor]
        codes[t, on] = value(len(on))
    return codes


def _split_tokens(gates: list[Gate]) -> dict[int, tuple[Gate, int]]:
    """Token ids of the split concepts: per concept its frequent token (both latents, 0) and
    a rare token for each latent alone (1, 2). Ids start at 1."""
    found, t = {}, 1
    for g in gates:
        if g.kind == "split":
            for which in range(SPLIT_TOKENS):
                found[t] = (g, which)
                t += 1
    return found


def _tokens(cfg: PlantedConfig, gates: list[Gate], rng) -> np.ndarray:
    """Rows of token ids: each split concept's frequent token 5% of the time, its rare ones
    1% each, every other id alike."""
    split = _split_tokens(gates)
    p = np.ones(cfg.vocab)
    p[0] = 0.0
    for t, (_, which) in split.items():
        p[t] = 0.0
    rest = 1.0 - sum(0.05 if which == 0 else 0.01 for _, which in split.values())
    p = p / p.sum() * rest
    for t, (_, which) in split.items():
        p[t] = 0.05 if which == 0 else 0.01
    return rng.choice(cfg.vocab, size=(cfg.rows, cfg.n_ctx), p=p).astype(np.int64)


def _labels(tokens: np.ndarray, codes: np.ndarray, gates: list[Gate]) -> dict[str, np.ndarray]:
    """Label channels `cue<i>` and `context<i>` of the i-th group AND: the tokens carrying one
    of its cues, one of its context's features."""
    on = codes != 0
    labels = {}
    for i, g in enumerate([g for g in gates if g.kind == "and" and len(g.side_a) > 1], start=1):
        labels[f"cue{i}"] = on[:, list(g.side_a)].any(1)[tokens].astype(np.int8)
        labels[f"context{i}"] = on[:, list(g.side_b)].any(1)[tokens].astype(np.int8)
    return labels


# ------------------------------------------------------------------ running the toolkit on it, and scoring


def analyse(world: PlantedWorld, circuits, features, verdicts) -> dict:
    """Every table the circuits, features and verdicts stages would write for the world's
    layer, from the same functions (`CircuitConfig`, `FeatureConfig`, `VerdictConfig`)."""
    from circuits.layer import Outputs
    from circuits.weights import from_hooked_transformer
    from pipelines.analysis.circuit_tables import analyse_layer
    from pipelines.analysis.features import feature_tables
    from pipelines.analysis.judge import CIRCUIT_READS, judge_layer
    from pipelines.analysis.verdicts import InputFacts
    from pipelines.inputs import layer_batches

    model, saes, rows = world.model, world.saes, world.rows
    sae_in, sae_out = saes.sae_in.weights, saes.sae_out.weights
    tables = analyse_layer(from_hooked_transformer(model, 0), sae_in, Outputs("sae", sae_out.W_enc.T, sae=sae_out),
                           layer_batches(model, rows, len(rows), saes), circuits, layer=0)
    described, labels = feature_tables(model, world.tokenizer, rows, {(0, RESID_MID): sae_in, (0, MLP_OUT): sae_out},
                                       features, world.classes, {}, None)
    facts = InputFacts.of(described, labels, 0, RESID_MID, verdicts)
    judged = judge_layer(model, saes, rows, {name: tables[name] for name in CIRCUIT_READS}, facts=facts,
                         tags=(), boosted={}, cfg=verdicts)
    return {**tables, **judged, "features": described}


def score(world: PlantedWorld, tables: dict) -> tuple[pd.DataFrame, dict]:
    """Per planted output, what the toolkit made of it; and the recovery figures: precision and
    recall of the planted ANDs among the k best candidates by circuit_rank (pairs: k = the
    planted pair ANDs; group gates: k = every planted AND), whether every split concept (and the
    square) ranks after every other candidate, the share of planted outputs whose planted candidate gets a
    right `gate_type`, and whether the ablations confirm every planted AND and reject every
    other planted output."""
    verdicts = tables["gate_verdicts"]
    ands = [g for g in world.gates if g.is_and]
    pair_ands = [g for g in ands if len(g.side_a) == len(g.side_b) == 1]
    rows, summary = [], {"planted ANDs": len(ands), "planted pair ANDs": len(pair_ands)}
    by_output = {g.output: g for g in world.gates}
    for kind, targets in (("pair", pair_ands), ("group", ands)):
        k, wanted = len(targets), {g.output for g in targets}
        mine = verdicts[verdicts["kind"] == kind].sort_values("circuit_rank")
        for n in (k, 2 * k):
            top = mine.head(n)
            found = [int(r.out_feature) for r in top.itertuples() if int(r.out_feature) in wanted
                     and _matches(by_output[int(r.out_feature)], *_sides(r))]
            summary[f"{kind}s: precision in top {n}"] = len(found) / n
            summary[f"{kind}s: recall in top {n}"] = len(set(found)) / k  # an AND found twice is recalled once
        concepts = [set(g.side_a + g.side_b) for g in world.gates if g.kind in ("split", "square")]
        ranked_as_gates = [r for r in mine.head(2 * k).itertuples() if not r.split_pair
                           and any(c <= set(r.members_a) | set(r.members_b) for c in concepts)]
        summary[f"{kind}s: no split concept among the top {2 * k} as a gate"] = not ranked_as_gates
    for g in world.gates:
        if g.kind == "distractor":
            continue
        row = {"planted": g.name, "kind": g.kind, "output": g.output,
               "side a": list(g.side_a), "side b": list(g.side_b), "gate_type": planted_type(g, tables)}
        row["type right"] = row["gate_type"] in g.expected_types
        for kind in ("pair", "group"):
            mine = verdicts[(verdicts["kind"] == kind) & (verdicts["out_feature"] == g.output)]
            if mine.empty:
                row.update({f"{kind} found": "-", f"{kind} rank": None, f"{kind} AND": None})
                continue
            r = mine.iloc[0]
            sides = " x ".join(str(list(side)) for side in _sides(r))
            row.update({f"{kind} found": sides + (" (split)" if r.split_pair else ""),
                        f"{kind} rank": int(r.circuit_rank), f"{kind} AND": bool(r.is_and),
                        f"{kind} keeps a/b": f"{_keeps(r.drop_a)}/{_keeps(r.drop_b)}"})
        rows.append(row)
    frame = pd.DataFrame(rows)
    planted_ands = frame[frame["kind"] == "and"]
    others = frame[frame["kind"] != "and"]
    summary["gate_type right (share of planted outputs)"] = float(frame["type right"].mean())
    summary["group ablation confirms every planted AND"] = bool(planted_ands["group AND"].fillna(False).all())
    summary["group ablation rejects every other planted output"] = not bool(others["group AND"].fillna(False).any())
    summary["pair ablation rejects every other planted output"] = not bool(others["pair AND"].fillna(False).any())
    return frame, summary


def planted_type(gate: Gate, tables: dict) -> str:
    """The `gate_type` of a planted output's own candidate: its pair in `pair_gates` (a pair
    gate), or its best-ranked group gate whose sides match the planted ones; `missing` when
    the toolkit never made that candidate."""
    if len(gate.side_a) == len(gate.side_b) == 1:
        pairs = tables["pair_gates"]
        a, b = sorted((gate.side_a[0], gate.side_b[0]))
        mine = pairs[(pairs["out_feature"] == gate.output) & (pairs["in_a"] == a) & (pairs["in_b"] == b)]
        return str(mine["gate_type"].iloc[0]) if len(mine) else "missing"
    groups = tables["group_gates"]
    mine = groups[groups["out_feature"] == gate.output]
    a, b = CIRCUIT_SIDES["group"]
    mine = mine[[_matches(gate, x, y) for x, y in zip(mine[a], mine[b])]]
    return str(mine.sort_values("circuit_rank")["gate_type"].iloc[0]) if len(mine) else "missing"


def _sides(row) -> tuple[list[int], list[int]]:
    """A verdict row's circuit sides (`CIRCUIT_SIDES`)."""
    a, b = CIRCUIT_SIDES[row.kind]
    return list(getattr(row, a)), list(getattr(row, b))


def _matches(gate: Gate, side_a, side_b) -> bool:
    """The found sides hit both planted sides without mixing them (either order): one holds
    inputs of planted side A and none of side B, the other the reverse."""
    x, y, a, b = set(side_a), set(side_b), set(gate.side_a), set(gate.side_b)
    return any(p & a and q & b and not p & b and not q & a for p, q in ((x, y), (y, x)))


def _keeps(drop) -> str:
    return "-" if drop is None or drop != drop else f"{1 - drop:.0%}"
