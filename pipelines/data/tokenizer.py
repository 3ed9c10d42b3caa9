"""The tokenizer: byte-pair merges within words that carry a word-start mark, via `tokenizers`.

Text is NFKC-normalised, optionally lower-cased (the paper lower-cases), and whitespace runs
become single spaces. Each word then starts with `▁` (SentencePiece's Metaspace mark), and
punctuation, digits and quotes split off, but apostrophes inside words stay (so "didn't"
can become "▁didn" + "'t" rather than `n ' t`). Merges never cross a word boundary, and a
word-start piece differs from the same letters inside a word: "▁but" (the word) is not
"but" (in "contri-but-ion"). `display_token` shows pieces as a reader expects: a word
start plainly, a piece inside a word with a leading `##`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from circuits.config import Config, option
from pipelines.engine.paths import ModelPaths

BOS, EOS, PAD, UNK = "[BOS]", "[EOS]", "[PAD]", "[UNK]"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
WORD_START = "\u2581"
# punctuation and symbol runs (with the word-start mark of a space before them), digits one
# by one, and quotes that are not inside a word
_SPLIT = Regex(r"\u2581?[^\w\s'\u2581]+|\d|\u2581?'(?!\w)|(?<!\w)'")
# a space after an opening quote or bracket that starts a word, so the word keeps its
# word-start mark ('"I am' -> '"', '▁i', '▁am', not '"', 'i'); decoded text shows that space
_OPENING = Regex("(?<=(?:^|\\s)[\"'(\\[{\u201c\u2018])(?=\\w)")


@dataclass(frozen=True)
class TokenizerConfig(Config):
    """How the tokenizer is trained."""

    vocab_size: int = option(4096, "tokenizer vocabulary, special tokens included (the paper's 4096)", low=16)
    min_frequency: int = option(2, "a merge must occur at least this often in the training text", low=1)
    lowercase: bool = option(True, "lower-case text before tokenizing (the paper does)")
    train_docs: int = option(200_000, "documents the tokenizer learns its merges from", low=1)


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig) -> Tokenizer:
    """Train a word-start-marking BPE tokenizer (see the module docstring) on `texts`."""
    steps = [normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Replace(_OPENING, " ")]
    if cfg.lowercase:
        steps.append(normalizers.Lowercase())
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement=WORD_START, prepend_scheme="always", split=True),
        pre_tokenizers.Split(_SPLIT, behavior="isolated"),
    ])
    tok.decoder = decoders.Metaspace(replacement=WORD_START, prepend_scheme="always", split=True)
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
        path = ModelPaths(path).tokenizer
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer at {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a damaged file
        raise ValueError(f"{path} is not a readable tokenizer file: {err}") from None


def special_ids(tok: Tokenizer) -> list[int]:
    """Ids of the special tokens the tokenizer has (a converted one may have none)."""
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    added = [t.id if hasattr(t, "id") else i for i, t in tok.get_added_tokens_decoder().items()]
    return sorted({i for i in ids + added if i is not None})


def display_token(piece: str) -> str:
    """A vocabulary piece as a reader expects it: `▁good` -> `good`, `ing` -> `##ing`,
    punctuation as is."""
    if piece.startswith(WORD_START):
        return piece[1:] or " "
    if piece[:1].isalnum():
        return "##" + piece
    return piece


def join_pieces(pieces: list[str]) -> str:
    """Pieces back to text: word starts become spaces, pieces inside words join directly."""
    return "".join(" " + p[1:] if p.startswith(WORD_START) else p for p in pieces).strip()
