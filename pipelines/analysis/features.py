"""Describe SAE features: how often and how strongly they fire, where, and what they boost.

One pass over the corpus encodes every (layer, site) SAE's activations and keeps, per
feature, running counts, sums, the top-activating tokens and, on the built-in corpus, how
much of its activation falls inside negations and in positive or negative contexts.

For `mlp_out` features, `valence_boost` is the mean direct logit effect on the positive
sentiment words minus that on the negative ones, in standard deviations of the feature's
effects over the whole vocabulary: how strongly it predicts one valence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pandas as pd
import torch
from sae_lens import SAE
from tokenizers import Tokenizer
from tqdm.auto import tqdm
from transformer_lens import HookedTransformer

from pipelines.data import TokenRows
from pipelines.stories import NEGATIVE, POSITIVE
from pipelines.tokenizer import BOS
from pipelines.valence import word_ids
from sae.activations import iter_activations, keep_mask
from sae.sites import Point


@dataclass
class FeatureConfig:
    """How features are described."""

    n_rows: int = 1024  # corpus rows scanned (of n_ctx tokens each)
    n_contexts: int = 5  # top-activating contexts kept per feature
    left: int = 8  # tokens shown before the active token
    right: int = 2  # tokens shown after it
    n_logit_tokens: int = 6  # boosted and suppressed tokens listed for mlp_out features
    batch_rows: int = 32  # rows per model pass

    def to_json(self) -> dict:
        return asdict(self)


class _Tracker:
    """Running statistics of one SAE's features over token batches."""

    def __init__(self, n_features: int, n_top: int, labelled: bool):
        self.count = torch.zeros(n_features, dtype=torch.float64)
        self.total = torch.zeros(n_features, dtype=torch.float64)
        self.max = torch.zeros(n_features)
        self.top_val = torch.full((n_top, n_features), -1.0)
        self.top_idx = torch.zeros((n_top, n_features), dtype=torch.int64)
        self.mass = {name: torch.zeros(n_features, dtype=torch.float64)
                     for name in ("negation", "positive_context", "negative_context")} if labelled else {}
        self.n_tokens = 0

    def update(self, acts: torch.Tensor, flat_idx: torch.Tensor, labels: dict[str, torch.Tensor]) -> None:
        """acts: [n, n_features] for the tokens at flat corpus indices `flat_idx` [n]."""
        self.n_tokens += acts.shape[0]
        self.count += (acts > 0).sum(0)
        self.total += acts.sum(0, dtype=torch.float64)
        self.max = torch.maximum(self.max, acts.max(0).values)
        k = min(self.top_val.shape[0], acts.shape[0])
        vals, pos = acts.topk(k, dim=0)
        merged_val = torch.cat([self.top_val, vals])
        merged_idx = torch.cat([self.top_idx, flat_idx[pos]])
        best = merged_val.topk(self.top_val.shape[0], dim=0).indices
        self.top_val = merged_val.gather(0, best)
        self.top_idx = merged_idx.gather(0, best)
        if self.mass:
            a = acts.double()
            self.mass["negation"] += (a * (labels["negation"] == 1).unsqueeze(1)).sum(0)
            self.mass["positive_context"] += (a * (labels["context"] == 1).unsqueeze(1)).sum(0)
            self.mass["negative_context"] += (a * (labels["context"] == -1).unsqueeze(1)).sum(0)


def _context(tok: Tokenizer, tokens: torch.Tensor, flat: int, cfg: FeatureConfig) -> str:
    """The window around corpus token `flat`, with the active token in brackets."""
    row, pos = divmod(flat, tokens.shape[1])
    ids = tokens[row]
    left = [tok.id_to_token(int(t)) for t in ids[max(0, pos - cfg.left) : pos]]
    right = [tok.id_to_token(int(t)) for t in ids[pos + 1 : pos + 1 + cfg.right]]
    return " ".join(left + [f"[{tok.id_to_token(int(ids[pos]))}]"] + right)


def logit_effects(model: HookedTransformer, sae: SAE) -> torch.Tensor:
    """Direct effect of each decoder direction on the logits: [n_features, d_vocab].

    The final RMS norm's gain is applied; its per-token scale is positive and only
    rescales the row, so the ranking of tokens is exact.
    """
    gain = getattr(model.ln_final, "w", None)
    directions = sae.W_dec if gain is None else sae.W_dec * gain
    return directions @ model.W_U


def describe(row: dict) -> str:
    """A short label of a feature from its ground truth and boosted tokens."""
    parts = []
    if row.get("share_negation", 0) >= 0.5:
        parts.append(f"negation {row['share_negation']:.0%}")
    for side in ("positive", "negative"):
        share = row.get(f"share_{side}_context", 0)
        if share >= 0.7:
            parts.append(f"{side} context {share:.0%}")
    if row.get("top_tokens"):
        parts.append("on " + ", ".join(row["top_tokens"][:3]))
    boost = row.get("valence_boost", float("nan"))
    if abs(boost) >= 1.0:
        parts.append(f"predicts {'positive' if boost > 0 else 'negative'} words ({boost:+.1f} sd)")
    if row.get("boosted_tokens"):
        parts.append("boosts " + ", ".join(row["boosted_tokens"][:4]))
    return "; ".join(parts)


@torch.no_grad()
def feature_table(
    model: HookedTransformer,
    tok: Tokenizer,
    rows: TokenRows,
    saes: dict[Point, SAE],
    cfg: FeatureConfig,
) -> pd.DataFrame:
    """One row per (layer, site, feature), described from `cfg.n_rows` corpus rows."""
    rows = rows.take(slice(0, cfg.n_rows))
    tokens = rows.tokens
    keep = keep_mask(tokens, bos_id=tok.token_to_id(BOS))
    labelled = "negation" in rows.labels
    trackers = {p: _Tracker(sae.cfg.d_sae, cfg.n_contexts, labelled) for p, sae in saes.items()}
    flat_all = torch.arange(tokens.numel()).reshape(tokens.shape)
    batches = iter_activations(model, tokens, list(saes), keep=keep, batch_seqs=cfg.batch_rows)
    bar = tqdm(total=len(tokens), desc="features", unit="row")
    # iter_activations skips batches with nothing kept; pair each yield with its own rows
    starts = [s for s in range(0, len(tokens), cfg.batch_rows) if keep[s : s + cfg.batch_rows].any()]
    for start, acts in zip(starts, batches, strict=True):
        part = slice(start, start + cfg.batch_rows)
        flat = flat_all[part][keep[part]]
        labels = {k: v[part][keep[part]] for k, v in rows.labels.items()}
        for point, x in acts.items():
            trackers[point].update(saes[point].encode(x), flat, labels)
        bar.update(min(cfg.batch_rows, len(tokens) - start))
    bar.close()

    pos_ids, neg_ids = word_ids(tok, POSITIVE), word_ids(tok, NEGATIVE)
    records = []
    for (layer, site), tr in trackers.items():
        effects = logit_effects(model, saes[(layer, site)]) if site == "mlp_out" else None
        for f in range(len(tr.count)):
            n_active = int(tr.count[f])
            fired = tr.top_val[:, f] > 0
            top = tr.top_idx[:, f][fired].tolist()
            row = {
                "layer": layer, "site": site, "feature": f,
                "frequency": n_active / max(1, tr.n_tokens),
                "max_activation": float(tr.max[f]),
                "mean_activation": float(tr.total[f] / n_active) if n_active else 0.0,
                "top_contexts": [_context(tok, tokens, i, cfg) for i in top],
                "top_tokens": [tok.id_to_token(int(tokens.view(-1)[i])) for i in top],
                "boosted_tokens": [], "suppressed_tokens": [],
            }
            if effects is not None:
                if pos_ids and neg_ids:
                    e = effects[f]
                    row["valence_boost"] = float((e[pos_ids].mean() - e[neg_ids].mean()) / e.std())
                order = effects[f].argsort(descending=True)
                row["boosted_tokens"] = [tok.id_to_token(int(i)) for i in order[: cfg.n_logit_tokens]]
                row["suppressed_tokens"] = [tok.id_to_token(int(i)) for i in order[-cfg.n_logit_tokens:].flip(0)]
            for name, mass in tr.mass.items():
                row[f"share_{name}"] = float(mass[f] / tr.total[f]) if tr.total[f] > 0 else float("nan")
            row["description"] = describe(row)
            records.append(row)
    return pd.DataFrame(records)
