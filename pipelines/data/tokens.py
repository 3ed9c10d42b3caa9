"""Tokenize a corpus and pack it into fixed-length rows, with per-token ground truth.

Documents are joined with EOS into one stream and cut into rows of `n_ctx - 1` tokens, each
row starting with BOS, so no position is wasted on padding. The built-in corpus's character
spans become per-token labels aligned with the rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from pipelines.corpus import TEXT_COLUMN, frame_stories, has_ground_truth
from pipelines.stories import Story
from pipelines.tokenizer import BOS, EOS

LABELS = ("negation", "sentiment", "context")  # token is a negation cue; word valence; context valence


@dataclass
class TokenRows:
    """A packed corpus: `tokens` [n_seq, n_ctx]; `labels[name]` [n_seq, n_ctx] int8 or absent."""

    tokens: torch.Tensor
    labels: dict[str, torch.Tensor]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def take(self, rows: slice | torch.Tensor) -> "TokenRows":
        return TokenRows(self.tokens[rows], {k: v[rows] for k, v in self.labels.items()})


def story_token_labels(story: Story, offsets: list[tuple[int, int]]) -> np.ndarray:
    """Labels [3, n_tokens] (negation 0/1, sentiment ±1/0, context ±1/0) from char spans."""
    starts = np.array([a for a, _ in offsets])
    ends = np.array([b for _, b in offsets])
    out = np.zeros((3, len(offsets)), dtype=np.int8)

    def inside(a: int, b: int) -> np.ndarray:
        return (starts >= a) & (ends <= b) & (ends > starts)

    for a, b in story.negation_spans:
        out[0, inside(a, b)] = 1
    for a, b, v in story.sentiment_spans:
        out[1, inside(a, b)] = v
    for a, b, v in story.context_spans:
        out[2, inside(a, b)] = v
    return out


def pack_corpus(df: pd.DataFrame, tok: Tokenizer, n_ctx: int, desc: str = "tokenize") -> TokenRows:
    """Tokenize every document of `df` and pack into rows of `n_ctx` tokens (BOS first, if any)."""
    if n_ctx < 2:
        raise ValueError(f"n_ctx must be at least 2, got {n_ctx}")
    # A tokenizer of our own has both; a converted model's may lack them, and then rows
    # simply start mid-text and documents run together.
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    sep = [] if eos is None else [eos]
    texts = df[TEXT_COLUMN].astype(str).tolist()
    stories = frame_stories(df) if has_ground_truth(df) else None
    ids: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    batch = 1024
    for i in tqdm(range(0, len(texts), batch), desc=desc, unit="batch", leave=False):
        for j, enc in enumerate(tok.encode_batch(texts[i : i + batch])):
            ids.append(np.array(enc.ids + sep, dtype=np.int64))
            if stories is not None:
                lab = story_token_labels(stories[i + j], enc.offsets)
                labels.append(np.concatenate([lab, np.zeros((3, len(sep)), np.int8)], axis=1))
    stream = np.concatenate(ids)
    head = 0 if bos is None else 1
    width = n_ctx - head
    n_rows = len(stream) // width
    if n_rows == 0:
        raise ValueError(f"corpus has {len(stream)} tokens, fewer than one row of {n_ctx}")
    tokens = torch.from_numpy(stream[: n_rows * width].reshape(n_rows, width))
    if head:
        tokens = torch.cat([torch.full((n_rows, 1), bos, dtype=torch.int64), tokens], dim=1)
    out: dict[str, torch.Tensor] = {}
    if labels:
        lab = np.concatenate(labels, axis=1)[:, : n_rows * width].reshape(3, n_rows, width)
        for k, name in enumerate(LABELS):
            out[name] = torch.cat(
                [torch.zeros((n_rows, head), dtype=torch.int8), torch.from_numpy(lab[k])], dim=1
            )
    return TokenRows(tokens, out)


def split_rows(rows: TokenRows, held_out: float, seed: int = 0) -> tuple[TokenRows, TokenRows]:
    """A seeded split into (train, held-out) rows."""
    n_eval = max(1, int(round(len(rows) * held_out)))
    if n_eval >= len(rows):
        raise ValueError(f"corpus gives {len(rows)} rows, too few to hold out {n_eval}")
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    return rows.take(perm[n_eval:]), rows.take(perm[:n_eval])
