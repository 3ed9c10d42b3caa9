"""Does the LM predict the right class of lexicon word, plainly and after a negation?

At every position whose next token is a whole lexicon word (say, a sentiment word), the
model's probability mass on each lexicon class's words is compared; the prediction is right
when the largest mass is on the next word's class. When the corpus labels negations (a
`negation` channel, as the built-in stories do), positions inside a negation are scored
apart from the others: on the stories, the word after a negation has the opposite valence
of its context, so getting it right needs the negation AND the context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipelines.data.labels import LEXICON_CHANNEL
from pipelines.data.tokens import TokenRows

if TYPE_CHECKING:  # annotations only: importing TransformerLens takes seconds
    from transformer_lens import HookedTransformer

NEGATION_CHANNEL = "negation"


@torch.no_grad()
def lexicon_accuracy(model: HookedTransformer, rows: TokenRows, lexicon_tokens: dict[str, list[int]],
                     classes: list[str], n_rows: int = 256, batch_size: int = 32) -> dict[str, float]:
    """Accuracy of the predicted lexicon class before lexicon words: `plain_accuracy`,
    `negated_accuracy` (with a negation channel) and the counts. `classes` is the lexicon
    channel's class order (its codes); `lexicon_tokens[c]` the whole-word token ids of c."""
    if LEXICON_CHANNEL not in rows.labels or len(lexicon_tokens) < 2:
        raise ValueError("lexicon accuracy needs a lexicon with at least two classes of whole-word tokens")
    order = [c for c in classes if c in lexicon_tokens]
    device = model.cfg.device
    hits = {"plain": [0, 0], "negated": [0, 0]}
    for part, tokens in rows.iter_batches(batch_size, n_rows):
        probs = model(tokens.to(device)).softmax(-1)[:, :-1]
        mass = torch.stack([probs[..., lexicon_tokens[c]].sum(-1) for c in order], -1)
        predicted = mass.argmax(-1).cpu()  # index into `order`
        codes = torch.from_numpy(rows.labels[LEXICON_CHANNEL][part][:, 1:].astype("int64"))
        target = torch.full_like(codes, -1)
        for i, c in enumerate(order):
            target[codes == classes.index(c) + 1] = i
        nxt = tokens[:, 1:]
        whole = torch.zeros_like(nxt, dtype=torch.bool)
        for c in order:
            whole |= torch.isin(nxt, torch.tensor(lexicon_tokens[c]))
        where = (target >= 0) & whole
        negated = torch.zeros_like(where)
        if NEGATION_CHANNEL in rows.labels:
            negated = torch.from_numpy(rows.labels[NEGATION_CHANNEL][part][:, :-1] != 0) & where
        right = (predicted == target) & where
        for kind, mask in (("plain", where & ~negated), ("negated", negated)):
            hits[kind][0] += int((right & mask).sum())
            hits[kind][1] += int(mask.sum())
    out = {f"{k}_count": n for k, (_, n) in hits.items()}
    out.update({f"{k}_accuracy": h / n for k, (h, n) in hits.items() if n})
    return out
