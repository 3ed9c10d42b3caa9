"""Describe SAE features on held-out text: how often and how strongly they fire, where, on
which tokens, what they predict, and which labels their activation falls on.

One pass over held-out rows encodes every SAE and keeps per feature running counts, sums,
the best-activating tokens (at most one per document, so one long document cannot fill
every slot), a uniform sample of its activations (for contexts at several quantiles, as
feature dashboards show), its activation mass per token id (a feature whose mass sits on
one token is flagged as a token feature) and per label class (`pipelines.data.labels`).

For `mlp_out` features the direct logit effect of the decoder direction (through the final
norm's gain) gives the boosted and suppressed tokens, special tokens and tokens the model
never trained on left out, and, with a lexicon, how strongly each lexicon class is boosted
(`boost_sd`: the class's mean effect minus the other classes', in standard deviations of
the effects over the vocabulary; only for classes of at least `min_lexicon_tokens` tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from circuits.config import Config, option, seed_option
from circuits.spectra import group_positions
from circuits.weights import SAEWeights
from pipelines.data.labels import LEXICON_CHANNEL
from pipelines.schemas import TABLES
from pipelines.data.tokenizer import WORD_START, display_token, special_ids
from pipelines.data.tokens import TokenRows
from sae.activations import iter_activations
from circuits.sites import OUTPUT_SITE, Point

if TYPE_CHECKING:  # annotations only: importing TransformerLens takes seconds
    from transformer_lens import HookedTransformer


@dataclass(frozen=True)
class FeatureConfig(Config):
    """How features are described."""

    n_rows: int = option(1024, "held-out rows scanned (of n_ctx tokens each)", low=1)
    n_contexts: int = option(5, "top-activating contexts kept per feature (one per document)", low=1)
    n_samples: int = option(6, "contexts at spread activation quantiles kept per feature", low=0)
    left: int = option(10, "tokens shown before the active token", low=0)
    right: int = option(3, "tokens shown after it", low=0)
    n_logit_tokens: int = option(6, "boosted and suppressed tokens listed for mlp_out features", low=1)
    min_token_count: int = option(10, "tokens seen fewer times in the LM's training are never listed as boosted", low=1)
    min_lexicon_tokens: int = option(5, "a lexicon class needs this many whole-word tokens for a boost", low=1)
    token_feature_share: float = option(0.5, "share of activation on one token that flags a token feature", low=0.0, high=1.0)
    label_share: float = option(0.5, "share of activation on a label class that puts it in the description", low=0.0, high=1.0)
    label_lift: float = option(1.5, "... if it is also this many times the class's share of all tokens", low=1.0)
    min_label_tokens: int = option(20, "active tokens a feature needs before a label is given", low=1)
    boost_sd: float = option(1.0, "|boost_sd| that puts 'predicts ... words' in the description", low=0.0)
    batch_rows: int = option(32, "rows per model pass", low=1, runtime=True)
    seed: int = seed_option("seeds the sample of activations the quantile contexts are drawn from")


def logit_effects(model: HookedTransformer, directions: torch.Tensor) -> torch.Tensor:
    """Direct effect of each direction `[n, d_model]` on the logits: `[n, d_vocab]`.

    Through the final RMS norm's gain; its per-token scale is positive, so the ranking of
    tokens is exact.
    """
    gain = getattr(model.ln_final, "w", None)
    directions = directions.to(model.W_U.dtype)
    return (directions if gain is None else directions * gain) @ model.W_U


def listable_tokens(tok: Tokenizer, d_vocab: int, counts: np.ndarray | None, min_count: int) -> torch.Tensor:
    """Bool `[d_vocab]`: tokens that may be listed as boosted: not special, seen in training."""
    ok = torch.ones(d_vocab, dtype=torch.bool)
    ok[[i for i in special_ids(tok) if i < d_vocab]] = False
    ok[tok.get_vocab_size():] = False  # embedding rows beyond the tokenizer never occur
    if counts is not None and len(counts):
        seen = torch.zeros(d_vocab, dtype=torch.bool)
        seen[: len(counts)] = torch.from_numpy(np.asarray(counts) >= min_count)
        ok &= seen
    return ok


def boosted_token_ids(model, W_dec: torch.Tensor, tok: Tokenizer, untrained: np.ndarray, n: int = 6) -> dict[int, list[int]]:
    """Per feature, the ids of its `n` most boosted listable tokens."""
    ok = listable_tokens(tok, model.cfg.d_vocab, None, 1)
    ok[torch.as_tensor(untrained, dtype=torch.long)] = False
    effects = logit_effects(model, W_dec).masked_fill(~ok.to(W_dec.device), float("-inf"))
    top = effects.topk(n, dim=-1).indices.cpu()
    return {f: top[f].tolist() for f in range(top.shape[0])}


class _Best:
    """Per feature, the `m` entries with the highest score seen so far; given groups (the
    documents of the tokens), at most one entry per group, its best."""

    def __init__(self, n_features: int, m: int):
        self.m = m
        self.score = torch.full((n_features, m), float("-inf"))
        self.value = torch.zeros(n_features, m)
        self.index = torch.full((n_features, m), -1, dtype=torch.long)
        self.group = torch.full((n_features, m), -1, dtype=torch.long)

    def add(self, feature: torch.Tensor, score: torch.Tensor, value: torch.Tensor, index: torch.Tensor,
            group: torch.Tensor | None = None) -> None:
        n = self.score.shape[0]
        # an entry below its feature's m-th best so far can never enter: most are dropped here
        worthy = score > self.score[feature, -1]
        feature, score, value, index = feature[worthy], score[worthy], value[worthy], index[worthy]
        group = None if group is None else group[worthy]
        kept = self.index.reshape(-1) >= 0
        old_feature = torch.arange(n).repeat_interleave(self.m)[kept]
        dedupe = group is not None
        group = torch.zeros_like(index) if group is None else group
        f = torch.cat([old_feature, feature])
        s = torch.cat([self.score.reshape(-1)[kept], score])
        v = torch.cat([self.value.reshape(-1)[kept], value])
        i = torch.cat([self.index.reshape(-1)[kept], index])
        g = torch.cat([self.group.reshape(-1)[kept], group])
        # sorted by feature, then group, then score descending
        order = torch.argsort(s, descending=True)
        order = order[torch.argsort(g[order], stable=True)]
        order = order[torch.argsort(f[order], stable=True)]
        f, s, v, i, g = f[order], s[order], v[order], i[order], g[order]
        first = torch.ones_like(f, dtype=torch.bool)
        first[1:] = (f[1:] != f[:-1]) | (g[1:] != g[:-1])
        if not dedupe:
            first[:] = True
        f, s, v, i, g = f[first], s[first], v[first], i[first], g[first]
        order = torch.argsort(s, descending=True)
        order = order[torch.argsort(f[order], stable=True)]
        f, s, v, i, g = f[order], s[order], v[order], i[order], g[order]
        rank = group_positions(f)
        keep = rank < self.m
        for name, source, fill in (("score", s, float("-inf")), ("value", v, 0.0), ("index", i, -1), ("group", g, -1)):
            table = torch.full((n, self.m), fill, dtype=source.dtype)
            table[f[keep], rank[keep]] = source[keep]
            setattr(self, name, table)


class _Tracker:
    """Running statistics of one SAE's features (see the module docstring)."""

    def __init__(self, n_features: int, d_vocab: int, cfg: FeatureConfig, classes: dict[str, list[str]]):
        self.count = torch.zeros(n_features, dtype=torch.float64)
        self.total = torch.zeros(n_features, dtype=torch.float64)
        self.abs_total = torch.zeros(n_features, dtype=torch.float64)  # label shares divide by it
        self.max = torch.full((n_features,), float("-inf"))
        self.token_mass = torch.zeros(n_features * d_vocab)
        self.d_vocab = d_vocab
        self.top = _Best(n_features, cfg.n_contexts)  # one context per document
        self.sample = _Best(n_features, max(8 * cfg.n_samples, 1))
        self.classes = classes
        self.mass = {c: torch.zeros(n_features, len(v), dtype=torch.float64) for c, v in classes.items()}
        self.class_tokens = {c: torch.zeros(len(v), dtype=torch.float64) for c, v in classes.items()}
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.n_tokens = 0

    def update(self, acts: torch.Tensor, flat: torch.Tensor, token_ids: torch.Tensor,
               labels: dict[str, torch.Tensor], documents: torch.Tensor | None = None) -> None:
        """acts `[t, n_features]` at corpus positions `flat [t]` with ids `token_ids [t]` in
        `documents [t]`."""
        acts = acts.float().cpu()
        self.n_tokens += acts.shape[0]
        token, feature = acts.nonzero(as_tuple=True)
        value = acts[token, feature]
        self.count += torch.bincount(feature, minlength=len(self.count)).double()
        self.total.index_add_(0, feature, value.double())
        self.abs_total.index_add_(0, feature, value.abs().double())
        self.max.scatter_reduce_(0, feature, value, reduce="amax")
        self.token_mass.index_add_(0, feature * self.d_vocab + token_ids[token], value.abs())
        self.top.add(feature, value, value, flat[token], None if documents is None else documents[token])
        keys = torch.rand(len(value), generator=self.generator)
        self.sample.add(feature, keys, value, flat[token])
        magnitude = value.abs().double()
        for channel, codes in labels.items():
            n_classes = len(self.classes[channel]) + 1  # code 0: no class
            self.class_tokens[channel] += torch.bincount(codes.long(), minlength=n_classes)[1:].double()
            where = feature * n_classes + codes[token].long()
            mass = torch.zeros(len(self.count) * n_classes, dtype=torch.float64).index_add_(0, where, magnitude)
            self.mass[channel] += mass.view(-1, n_classes)[:, 1:]


    def base_share(self, channel: str, i: int) -> float:
        """Share of the scanned tokens in class i of the channel."""
        return float(self.class_tokens[channel][i]) / max(1, self.n_tokens)


class _Windows:
    """Text windows around corpus positions of held-out rows, within one document."""

    def __init__(self, rows: TokenRows, tok: Tokenizer, cfg: FeatureConfig):
        self.tokens = np.asarray(rows.tokens)
        self.docs = rows.documents(slice(None))
        self.n_ctx = self.tokens.shape[1]
        self.pieces = [tok.id_to_token(i) or "?" for i in range(tok.get_vocab_size())]
        self.specials = set(special_ids(tok))
        self.cfg = cfg
        # each token's text in a context, plain and marked as the active one
        self.plain = [" " + p[1:] if p.startswith(WORD_START) else p for p in self.pieces]
        self.marked = [(" " if p.startswith(WORD_START) else "") + f"[{p.removeprefix(WORD_START)}]"
                       for p in self.pieces]

    def piece(self, index: int) -> str:
        return self.pieces[index] if index < len(self.pieces) else f"<{index}>"

    def document(self, flat: int) -> int:
        return int(self.docs.reshape(-1)[flat])

    def token(self, flat: int) -> str:
        return display_token(self.piece(int(self.tokens.reshape(-1)[flat])))

    def context(self, flat: int) -> str:
        row, pos = divmod(flat, self.n_ctx)
        lo, hi = max(0, pos - self.cfg.left), min(self.n_ctx, pos + 1 + self.cfg.right)
        # plain lists: indexing numpy scalars one by one costs more than the text itself
        ids, docs = self.tokens[row, lo:hi].tolist(), self.docs[row, lo:hi].tolist()
        own, n = docs[pos - lo], len(self.pieces)
        parts = [(self.marked if p == pos else self.plain)[index] if index < n else f"<{index}>"
                 for p, index, doc in zip(range(lo, hi), ids, docs) if doc == own and index not in self.specials]
        return "".join(parts).strip()


@torch.no_grad()
def feature_tables(model: HookedTransformer, tok: Tokenizer, rows: TokenRows, saes: dict[Point, SAEWeights],
                   cfg: FeatureConfig, classes: dict[str, list[str]], lexicon_tokens: dict[str, list[int]],
                   token_counts: np.ndarray | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The `features` and `feature_labels` tables of every given SAE, from `cfg.n_rows` rows."""
    rows = rows.head(cfg.n_rows)
    d_vocab = model.cfg.d_vocab
    trackers = {p: _Tracker(s.d_sae, d_vocab, cfg, classes) for p, s in saes.items()}
    bar = tqdm(total=len(rows), desc="features", unit="row")
    n_ctx = rows.n_ctx
    for part, tokens in rows.iter_batches(cfg.batch_rows):
        keep = rows.keep(tokens)
        flat = (torch.arange(part.start, part.stop)[:, None] * n_ctx + torch.arange(n_ctx))[keep]
        ids = tokens[keep]
        labels = {c: torch.from_numpy(np.array(v[part]))[keep] for c, v in rows.labels.items() if c in classes}
        documents = torch.from_numpy(rows.documents(part))[keep]
        for acts in iter_activations(model, tokens, list(saes), keep, cfg.batch_rows):
            for point, x in acts.items():
                trackers[point].update(saes[point].encode(x.to(saes[point].W_enc.dtype)), flat, ids, labels,
                                       documents)
        bar.update(part.stop - part.start)
    bar.close()

    windows = _Windows(rows, tok, cfg)
    listable = listable_tokens(tok, d_vocab, token_counts, cfg.min_token_count)
    records, label_records = [], []
    for (layer, site), tracker in trackers.items():
        effects = logit_effects(model, saes[(layer, site)].W_dec).cpu() if site == OUTPUT_SITE else None
        boosts = _lexicon_boosts(effects, listable, lexicon_tokens, cfg) if effects is not None else {}
        summary = _Summary(tracker, effects, listable, boosts, cfg)
        for f in range(len(tracker.count)):
            row = _describe_feature(tracker, f, windows, effects, listable, boosts, cfg, summary)
            records.append({"layer": layer, "site": site, "feature": f, **row})
            total = summary.abs_total[f] or float("nan")
            for channel, mass in summary.mass.items():
                for i, name in enumerate(tracker.classes[channel]):
                    share = mass[f][i] / total
                    base = summary.base[channel][i]
                    label_records.append({"layer": layer, "site": site, "feature": f, "channel": channel,
                                          "class": name, "kind": "activation_share", "value": share,
                                          "lift": share / base if base > 0 else float("nan"), "n_tokens": None})
            for name, (values, n) in summary.boosts.items():
                label_records.append({"layer": layer, "site": site, "feature": f, "channel": LEXICON_CHANNEL,
                                      "class": name, "kind": "logit_boost", "value": values[f],
                                      "lift": float("nan"), "n_tokens": n})
    features = pd.DataFrame(records, columns=TABLES["features"].names)
    labels = pd.DataFrame(label_records, columns=TABLES["feature_labels"].names)
    return features, labels


def _lexicon_boosts(effects: torch.Tensor, listable: torch.Tensor, lexicon_tokens: dict[str, list[int]],
                    cfg: FeatureConfig) -> dict[str, tuple[torch.Tensor, int]]:
    """Per lexicon class with enough tokens: `([n_features] boost in sd, n_tokens)`, each
    class's mean effect minus the mean of the other classes' means."""
    valid = effects[:, listable]
    sd = valid.std(-1).clamp_min(1e-12)
    means = {}
    for name, ids in lexicon_tokens.items():
        ids = [i for i in ids if i < len(listable) and listable[i]]
        if len(ids) >= cfg.min_lexicon_tokens:
            means[name] = (effects[:, ids].mean(-1), len(ids))
    if len(means) < 2:
        return {}
    out = {}
    for name, (mean, n) in means.items():
        others = torch.stack([m for other, (m, _) in means.items() if other != name]).mean(0)
        out[name] = ((mean - others) / sd, n)
    return out


class _Summary:
    """A tracker's per-feature figures, computed for every feature at once and held as
    Python lists, so that describing each feature only reads them."""

    def __init__(self, tracker: _Tracker, effects: torch.Tensor | None, listable: torch.Tensor | None, boosts: dict,
                 cfg: FeatureConfig):
        n = len(tracker.count)
        self.count, self.max = tracker.count.tolist(), tracker.max.tolist()
        self.total, self.abs_total = tracker.total.tolist(), tracker.abs_total.tolist()
        self.top = tracker.top.index.tolist()
        self.samples = _spread_samples(tracker, cfg.n_samples)
        mass = tracker.token_mass.view(n, tracker.d_vocab)
        best = mass.argmax(1)
        self.token_total, self.top_token = mass.sum(1).tolist(), best.tolist()
        self.top_token_mass = mass.gather(1, best[:, None])[:, 0].tolist()
        self.boosted = self.suppressed = None
        if effects is not None:
            e = effects.masked_fill(~listable, float("nan"))
            m = cfg.n_logit_tokens
            self.boosted = torch.argsort(torch.nan_to_num(e, nan=float("-inf")), dim=1, descending=True)[:, :m].tolist()
            self.suppressed = torch.argsort(torch.nan_to_num(e, nan=float("inf")), dim=1)[:, :m].tolist()
        self.mass = {channel: m.tolist() for channel, m in tracker.mass.items()}
        self.base = {channel: [tracker.base_share(channel, i) for i in range(len(names))]
                     for channel, names in tracker.classes.items()}
        self.boosts = {name: (values.tolist(), count) for name, (values, count) in boosts.items()}


def _describe_feature(tracker: _Tracker, f: int, windows: _Windows, effects, listable, boosts, cfg,
                      summary: _Summary | None = None) -> dict:
    """One row of the `features` table (`summary`: the tracker's, if already made)."""
    s = summary or _Summary(tracker, effects, listable, boosts, cfg)
    n_active = int(s.count[f])
    row = {
        "frequency": n_active / max(1, tracker.n_tokens),
        "max_activation": s.max[f] if n_active else 0.0,
        "mean_activation": s.total[f] / n_active if n_active else 0.0,
    }
    top = [i for i in s.top[f] if i >= 0]
    docs = [windows.document(i) for i in top]
    row["top_contexts"] = [windows.context(i) for i in top]
    row["top_documents"] = docs
    row["top_tokens"] = [windows.token(i) for i in top]
    samples = s.samples[f]
    row["sample_contexts"] = [windows.context(i) for i, _ in samples]
    row["sample_quantiles"] = [q for _, q in samples]
    total = s.token_total[f]
    if total > 0:
        row["top_token"] = display_token(windows.piece(s.top_token[f]))
        row["top_token_share"] = s.top_token_mass[f] / total
    else:
        row["top_token"], row["top_token_share"] = None, float("nan")
    row["is_token_feature"] = bool(total > 0 and row["top_token_share"] >= cfg.token_feature_share)
    row["boosted_tokens"], row["suppressed_tokens"] = [], []
    if s.boosted is not None:
        row["boosted_tokens"] = [display_token(windows.piece(i)) for i in s.boosted[f]]
        row["suppressed_tokens"] = [display_token(windows.piece(i)) for i in s.suppressed[f]]
    row["label"], row["label_share"] = None, float("nan")
    best_share = 0.0
    denominator = s.abs_total[f]
    for channel, mass_c in s.mass.items():
        if denominator <= 0 or n_active < cfg.min_label_tokens:
            continue
        for i, name in enumerate(tracker.classes[channel]):
            share = mass_c[f][i] / denominator
            # a share no higher than the class's share of all tokens says nothing: with two
            # balanced classes of documents every feature would get one at 50%
            if share >= cfg.label_share and share >= cfg.label_lift * s.base[channel][i] and share > best_share:
                best_share = share
                row["label"] = name if name == channel else f"{channel}={name}"
                row["label_share"] = share
    row["boost_label"], row["boost_sd"] = None, float("nan")
    if s.boosts:
        name = max(s.boosts, key=lambda c: s.boosts[c][0][f])
        row["boost_label"], row["boost_sd"] = name, s.boosts[name][0][f]
    row["description"] = describe(row, cfg)
    return row


def _spread_samples(tracker: _Tracker, n: int) -> list[list[tuple[int, float]]]:
    """Per feature, `n` sampled activations at evenly spread quantiles: (corpus position, quantile)."""
    index, values = tracker.sample.index, tracker.sample.value
    counts = (index >= 0).sum(1).tolist()  # a feature's samples fill the first slots of its row
    picks = {}  # by the number of samples: positions of the quantiles
    out = []
    for f, m in enumerate(counts):
        if n == 0 or m == 0:
            out.append([])
            continue
        if m not in picks:
            picks[m] = sorted({int(round(q * (m - 1))) for q in np.linspace(0.05, 0.95, n)})
        # one sort per feature, as ties between equal activations have always been broken
        order = torch.argsort(values[f, :m])[picks[m]].tolist()
        positions = index[f, :m].tolist()
        out.append([(positions[o], (i + 0.5) / m) for o, i in zip(order, picks[m])])
    return out


def describe(row: dict, cfg: FeatureConfig) -> str:
    """A short label of a feature from its statistics, labels and logit effects."""
    parts = []
    if row.get("is_token_feature"):
        parts.append(f"token feature: {row['top_token']!r} ({row['top_token_share']:.0%})")
    if row.get("label"):
        parts.append(f"{row['label']} {row['label_share']:.0%}")
    tokens = list(dict.fromkeys(row.get("top_tokens") or []))
    if tokens and not row.get("is_token_feature"):
        parts.append("on " + _listed(tokens[:3]))
    boost = row.get("boost_sd")
    if boost is not None and boost == boost and abs(boost) >= cfg.boost_sd:
        parts.append(f"predicts {row['boost_label']} words ({boost:+.1f} sd)")
    if row.get("boosted_tokens"):
        parts.append("boosts " + _listed(row["boosted_tokens"][:4]))
    return "; ".join(parts)


def _listed(tokens: list[str]) -> str:
    """Tokens joined by commas, punctuation quoted so that `,` and `.` stay readable."""
    return ", ".join(t if t.replace("#", "").replace("'", "").isalnum() else repr(t) for t in tokens)
