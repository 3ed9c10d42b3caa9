"""The tokenizer: byte-pair merges over lowercased words and punctuation, via `tokenizers`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

BOS, EOS, PAD, UNK = "[BOS]", "[EOS]", "[PAD]", "[UNK]"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]


@dataclass
class TokenizerConfig:
    """How the tokenizer is trained."""

    vocab_size: int = 1024  # vocabulary size including the special tokens
    min_frequency: int = 2  # a merge must occur at least this often


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig) -> Tokenizer:
    """Train a lowercase BPE tokenizer that splits on whitespace and each punctuation mark."""
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer at {path}")
    return Tokenizer.from_file(str(path))
