"""Tokenized corpora on disk: documents packed into rows, split by document, memory-mapped.

`build_token_store` reads a corpus once, in batches of documents, and writes a folder:

    info.json                     sizes, dtype, label classes, per-split document/token/byte counts
    {split}.tokens.bin            [n_rows, n_ctx] token ids (uint16, or int32 for large vocabularies)
    {split}.docs.bin              [n_rows] int64, the document at each row's first position
    {split}.documents.bin         [n_documents, 2] int64: each document of the split (its index in
                                  the corpus) and where its tokens end in the split's stream
    {split}.labels.{channel}.bin  [n_rows, n_ctx] int8 label codes (see `pipelines.data.labels`)
    token_counts.npy              [d_vocab] int64, how often each token occurs in the train rows

for the splits `train` and `held_out`. Each document is BOS followed by its tokens, and the
documents of a split follow each other in one stream that is cut into rows of `n_ctx`: BOS
marks only a document's start, and a long document simply continues in the next row. Which
documents are held out is decided per document by a seeded hash of its index, so the split
is reproducible and no document lies on both sides. Rows are read through memory maps, so no
stage holds a whole corpus in memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from pipelines.data.corpus import CorpusConfig, iter_documents
from pipelines.data.labels import Labeller, lexicon_token_ids, negation_cues, read_lexicon
from pipelines.data.tokenizer import BOS
from pipelines.engine.files import atomic_dir, read_json, write_json
from pipelines.engine.paths import TOKEN_COUNTS

SPLITS = ("train", "held_out")
INFO_FILE = "info.json"


def held_out_mask(doc_index: np.ndarray, share: float, seed: int) -> np.ndarray:
    """Whether each document (by its index in the corpus) is held out: a splitmix64 hash of
    index and seed, compared with `share`. Independent of batch sizes and reading order."""
    with np.errstate(over="ignore"):
        z = doc_index.astype(np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53) < share


@dataclass
class TokenRows:
    """One split's rows, memory-mapped. Slicing reads only the rows asked for."""

    tokens: np.ndarray  # [n_rows, n_ctx]
    row_doc: np.ndarray  # [n_rows], document of each row's first token
    labels: dict[str, np.ndarray]  # channel -> [n_rows, n_ctx] int8 codes
    bos_id: int | None
    doc_table: np.ndarray | None = None  # [n_documents, 2]: document index, end of its tokens in the stream

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_ctx(self) -> int:
        return self.tokens.shape[1]

    def head(self, n: int) -> "TokenRows":
        """The first `n` rows (a view)."""
        return TokenRows(self.tokens[:n], self.row_doc[:n], {k: v[:n] for k, v in self.labels.items()}, self.bos_id,
                         self.doc_table)

    def batch(self, rows: slice | np.ndarray) -> torch.Tensor:
        """Token ids of the given rows as a LongTensor `[n, n_ctx]`."""
        return torch.from_numpy(np.asarray(self.tokens[rows], dtype=np.int64))

    def keep(self, tokens: torch.Tensor) -> torch.Tensor:
        """Positions to analyse `[n, n_ctx]`: every token but BOS and the first of each row.

        Both are attention sinks whose activations are outliers no SAE should spend capacity
        on and no description should show: BOS wherever it falls, and a row's first token,
        which has nothing to attend to but itself even when it continues a document.
        """
        keep = torch.ones_like(tokens, dtype=torch.bool)
        keep[:, 0] = False
        if self.bos_id is not None:
            keep &= tokens != self.bos_id
        return keep

    def documents(self, rows: slice | np.ndarray) -> np.ndarray:
        """Document index of every token of the given rows, `[n, n_ctx]`."""
        if self.doc_table is not None:
            # a split's documents are not consecutive corpus indices (the other split's lie
            # between them), so they are looked up by where their tokens end in the stream
            index = np.arange(len(self))[rows]
            positions = index[:, None] * self.n_ctx + np.arange(self.n_ctx)
            table = np.asarray(self.doc_table)
            return table[np.searchsorted(table[:, 1], positions, side="right"), 0]
        tokens = np.asarray(self.tokens[rows])
        first = np.asarray(self.row_doc[rows])[:, None]
        if self.bos_id is None:
            return np.broadcast_to(first, tokens.shape).copy()
        starts = tokens == self.bos_id
        starts[:, 0] = False  # a BOS at position 0 starts the row's own first document
        return first + np.cumsum(starts, axis=1)

    def iter_batches(self, batch_rows: int, limit: int | None = None) -> Iterator[tuple[slice, torch.Tensor]]:
        """`(rows, tokens)` over the first `limit` rows (all by default)."""
        n = len(self) if limit is None else min(limit, len(self))
        for start in range(0, n, batch_rows):
            rows = slice(start, min(start + batch_rows, n))
            yield rows, self.batch(rows)


@dataclass
class TokenStore:
    """A tokenized corpus: both splits, its label classes and its statistics."""

    folder: Path
    info: dict
    train: TokenRows
    held_out: TokenRows

    @property
    def classes(self) -> dict[str, list[str]]:
        return self.info["classes"]

    @property
    def lexicon_tokens(self) -> dict[str, list[int]]:
        """Per lexicon class, the token ids that are whole lexicon words."""
        return self.info.get("lexicon_tokens", {})

    def token_counts(self) -> np.ndarray:
        return np.load(self.folder / TOKEN_COUNTS)

    def bytes_per_token(self, split: str = "held_out") -> float:
        stats = self.info["splits"][split]
        return stats["bytes"] / max(1, stats["tokens"])


def open_token_store(folder: str | Path) -> TokenStore:
    folder = Path(folder)
    info = read_json(folder / INFO_FILE)
    if info is None:
        raise FileNotFoundError(f"no token store at {folder}")
    dtype = np.dtype(info["dtype"])
    n_ctx = info["n_ctx"]
    bos = info["bos_id"]

    def rows(split: str) -> TokenRows:
        n = info["splits"][split]["rows"]
        tokens = np.memmap(folder / f"{split}.tokens.bin", dtype=dtype, mode="r", shape=(n, n_ctx))
        docs = np.memmap(folder / f"{split}.docs.bin", dtype=np.int64, mode="r", shape=(n,))
        labels = {c: np.memmap(folder / f"{split}.labels.{c}.bin", dtype=np.int8, mode="r", shape=(n, n_ctx))
                  for c in info["classes"]}
        table_file = folder / f"{split}.documents.bin"  # absent in stores written before it existed
        table = np.fromfile(table_file, dtype=np.int64).reshape(-1, 2) if table_file.is_file() else None
        return TokenRows(tokens, docs, labels, bos, table)

    return TokenStore(folder, info, rows("train"), rows("held_out"))


class _SplitWriter:
    """Appends one split's documents to its stream and writes every full row to disk."""

    def __init__(self, folder: Path, split: str, n_ctx: int, dtype: np.dtype, d_vocab: int):
        self.folder, self.split, self.n_ctx, self.dtype = folder, split, n_ctx, dtype
        self.counts = np.zeros(d_vocab, dtype=np.int64)  # of the tokens written into rows
        self.doc_table: list[tuple[int, int]] = []  # (document, end of its tokens in the stream)
        self.streamed = 0
        self.tokens: list[np.ndarray] = []
        self.docs: list[np.ndarray] = []
        self.labels: dict[str, list[np.ndarray]] = {}
        self.pending = 0
        self.rows = 0
        self.files = {"tokens": open(folder / f"{split}.tokens.bin", "wb"),
                      "docs": open(folder / f"{split}.docs.bin", "wb")}
        self.stats = {"documents": 0, "tokens": 0, "bytes": 0, "rows": 0}

    def add(self, ids: np.ndarray, doc: int, labels: dict[str, np.ndarray], n_bytes: int, n_tokens: int) -> None:
        """Append a document: `ids` (with BOS when the tokenizer has one), `n_tokens` of them text."""
        for channel in labels:
            if channel not in self.labels:  # a channel first seen now: earlier tokens had none
                self.labels[channel] = [np.zeros(self.pending, dtype=np.int8)]
                path = self.folder / f"{self.split}.labels.{channel}.bin"
                self.files[channel] = open(path, "wb")
                self.files[channel].write(np.zeros(self.rows * self.n_ctx, dtype=np.int8).tobytes())
        self.tokens.append(ids)
        self.docs.append(np.full(len(ids), doc, dtype=np.int64))
        for channel, parts in self.labels.items():
            parts.append(labels.get(channel, np.zeros(len(ids), dtype=np.int8)))
        self.pending += len(ids)
        self.stats["documents"] += 1
        self.stats["tokens"] += n_tokens
        self.streamed += len(ids)
        self.doc_table.append((doc, self.streamed))
        self.stats["bytes"] += n_bytes
        if self.pending >= self.n_ctx:
            self._flush()

    def _flush(self) -> None:
        tokens = np.concatenate(self.tokens)
        n_rows = len(tokens) // self.n_ctx
        cut = n_rows * self.n_ctx
        docs = np.concatenate(self.docs)
        self.files["tokens"].write(tokens[:cut].astype(self.dtype).tobytes())
        self.counts += np.bincount(tokens[:cut], minlength=len(self.counts))
        self.files["docs"].write(docs[:cut:self.n_ctx].tobytes())
        self.tokens, self.docs = [tokens[cut:]], [docs[cut:]]
        for channel, parts in self.labels.items():
            codes = np.concatenate(parts)
            self.files[channel].write(codes[:cut].tobytes())
            self.labels[channel] = [codes[cut:]]
        self.pending -= cut
        self.rows += n_rows

    def close(self) -> dict:
        for handle in self.files.values():
            handle.close()
        np.asarray(self.doc_table, dtype=np.int64).reshape(-1, 2).tofile(self.folder / f"{self.split}.documents.bin")
        self.stats["rows"] = self.rows
        return self.stats


def build_token_store(
    source: str, tok: Tokenizer, n_ctx: int, cfg: CorpusConfig, folder: str | Path, corpus_name: str | None = None,
) -> TokenStore:
    """Tokenize and pack `source` into a token store at `folder` (written atomically)."""
    if n_ctx < 2:
        raise ValueError(f"rows need at least 2 tokens, got n_ctx={n_ctx}")
    bos = tok.token_to_id(BOS)
    d_vocab = tok.get_vocab_size()
    dtype = np.dtype(np.uint16 if d_vocab <= np.iinfo(np.uint16).max else np.int32)
    lowercase = _lowercases(tok)
    lexicon = read_lexicon(cfg.lexicon, lowercase) if cfg.lexicon else None
    labeller = Labeller(lexicon, cfg.label_column, lowercase, negation_cues(cfg.negation, lowercase), cfg.context)
    skipped = 0
    with atomic_dir(folder) as tmp:
        writers = {split: _SplitWriter(tmp, split, n_ctx, dtype, d_vocab) for split in SPLITS}
        doc = 0
        bar = tqdm(desc="tokenize", unit="doc")
        for batch in iter_documents(source, cfg):
            skipped += batch.skipped
            held = held_out_mask(np.arange(doc, doc + len(batch.texts)), cfg.held_out, cfg.split_seed)
            for i, enc in enumerate(_encode_as_text(tok, batch.texts)):
                text = batch.texts[i]
                ids = np.asarray(enc.ids, dtype=np.int64)
                offsets = _word_offsets(text, enc.offsets)
                labels = labeller.label(text, offsets, batch.classes[i] if batch.classes else None,
                                        batch.spans[i] if batch.spans else None, lead=int(bos is not None))
                if bos is not None:
                    ids = np.concatenate([[bos], ids])
                split = "held_out" if held[i] else "train"
                writers[split].add(ids, doc + i, labels, len(text.encode("utf-8")), len(enc.ids))
            doc += len(batch.texts)
            bar.update(len(batch.texts))
        bar.close()
        stats = {split: writer.close() for split, writer in writers.items()}
        if doc == 0:
            raise ValueError(f"corpus {source} has no documents with text ({skipped} empty or null)")
        for split, name in (("train", "training"), ("held_out", "held-out")):
            if stats[split]["rows"] == 0:
                raise ValueError(
                    f"corpus {source} is too small: its {stats[split]['documents']} {name} documents "
                    f"({stats[split]['tokens']} tokens) fill no row of {n_ctx} tokens; give more text"
                    + (" or raise --held-out" if split == "held_out" else ""))
        for writer in writers.values():  # channels first seen late still need full-length files
            for channel in labeller.classes:
                path = tmp / f"{writer.split}.labels.{channel}.bin"
                missing = writer.rows * n_ctx - (path.stat().st_size if path.exists() else 0)
                with open(path, "ab") as handle:
                    handle.write(np.zeros(max(0, missing), dtype=np.int8).tobytes())
        np.save(tmp / TOKEN_COUNTS, writers["train"].counts)
        info = {
            "corpus": corpus_name or source, "n_ctx": n_ctx, "dtype": dtype.name, "bos_id": bos,
            "d_vocab": d_vocab, "documents": doc, "skipped_documents": skipped,
            "splits": stats, "classes": labeller.classes,
            "lexicon_tokens": lexicon_token_ids(tok, lexicon) if lexicon else {},
        }
        write_json(tmp / INFO_FILE, info)
    if skipped:
        print(f"corpus {source}: skipped {skipped} documents with null or blank text")
    return open_token_store(folder)


def _encode_as_text(tok: Tokenizer, texts: list[str]) -> list:
    """Encodings of `texts` in which a special token's name written in the text ("[BOS]" in a
    document about tokenizers) is plain text, not the special token: a BOS comes only from
    the store, at a document's start."""
    previous = getattr(tok, "encode_special_tokens", None)
    if previous is None:  # tokenizers before 0.15 cannot say so
        return tok.encode_batch(texts)
    tok.encode_special_tokens = True
    try:
        return tok.encode_batch(texts)
    finally:
        tok.encode_special_tokens = previous


def _word_offsets(text: str, offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Character offsets without the space a word-start piece carries in front of it."""
    out = []
    for start, end in offsets:
        while start < end and text[start].isspace():
            start += 1
        out.append((start, end))
    return out


def _lowercases(tok: Tokenizer) -> bool:
    """Whether the tokenizer lower-cases its input (then lexicon words are matched lower-cased)."""
    probe = "Ab"
    return tok.normalizer is not None and tok.normalizer.normalize_str(probe) == probe.lower()


def unigram_entropy(counts: np.ndarray) -> float:
    """Entropy in nats of token frequencies: the loss of a model that ignores context."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def bits_per_byte(loss_nats: float, bytes_per_token: float) -> float:
    """Loss per token (nats) as bits per byte of text, comparable across vocabularies."""
    return loss_nats / math.log(2) / bytes_per_token
