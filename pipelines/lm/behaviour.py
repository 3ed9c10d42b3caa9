"""Does the LM predict the right valence after a negation? A behavioural check on ground truth.

At every position whose next token is a sentiment word, compare the probability the model
puts on positive words with that on negative words; the prediction is right when the larger
side matches the next word's valence. Scored separately for negated positions (the next
word's valence is opposite to the context's) and plain ones.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer
from transformer_lens import HookedTransformer

from pipelines.data import TokenRows
from pipelines.stories import NEGATIVE, POSITIVE


def word_ids(tok: Tokenizer, words: list[str]) -> list[int]:
    """Ids of the words the tokenizer keeps whole (the demo tokenizer keeps them all)."""
    ids = [tok.token_to_id(w) for w in words]
    return [i for i in ids if i is not None]


@torch.no_grad()
def valence_accuracy(model: HookedTransformer, rows: TokenRows, tok: Tokenizer,
                     batch_size: int = 32) -> dict[str, float]:
    """Accuracy of the predicted valence before sentiment words, plain and negated.

    Needs the built-in corpus's labels; returns counts and accuracies.
    """
    if "sentiment" not in rows.labels:
        raise ValueError("valence accuracy needs a corpus with ground truth (the built-in one)")
    pos, neg = word_ids(tok, POSITIVE), word_ids(tok, NEGATIVE)
    hits = {"plain": [0, 0], "negated": [0, 0]}
    for i in range(0, len(rows), batch_size):
        part = rows.take(slice(i, i + batch_size))
        probs = model(part.tokens).softmax(-1)[:, :-1]
        margin = probs[..., pos].sum(-1) - probs[..., neg].sum(-1)
        target = part.labels["sentiment"][:, 1:].to(torch.int64)
        context = part.labels["context"][:, 1:].to(torch.int64)
        where = target != 0
        right = (margin.sign().to(torch.int64) == target) & where
        negated = where & (target == -context)
        for kind, mask in (("plain", where & ~negated), ("negated", negated)):
            hits[kind][0] += int((right & mask).sum())
            hits[kind][1] += int(mask.sum())
    return {
        **{f"{k}_accuracy": (h / n if n else float("nan")) for k, (h, n) in hits.items()},
        **{f"{k}_count": n for k, (_, n) in hits.items()},
    }
