"""Corpora: read any supported source as a stream of documents (the built-in one is written by
`pipelines.data.story_corpus`).

A corpus source is one of
- a Parquet file or folder, or a JSONL file (one JSON object per line), with a text column
  (`text` unless `--text-column` says otherwise);
- a plain text file, one document per blank-line-separated paragraph;
- any of those files compressed with gzip (`.gz`), bzip2 (`.bz2`), xz (`.xz`) or
  zstandard (`.zst`), read as they are;
- a folder saved by `datasets.Dataset.save_to_disk`;
- `hf:<name>[:<split>]`, a `datasets` dataset by name, streamed (a local cache offline).

Documents come in batches (`Documents`), so no corpus is ever held whole. Besides the text a
document may carry a class (`--label-column`, e.g. a review's polarity) and character spans
with labels (a `spans` column of `[start, end, label]` triples, as the built-in stories
have), which `pipelines.data.labels` turns into per-token labels. Null or blank texts are
skipped and counted; a text column that holds no text, or bytes that are not UTF-8, are
errors that name the file.
"""

from __future__ import annotations

import bz2
import gzip
import io
import itertools
import json
import lzma
import numbers
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from circuits.config import Config, option, seed_option
from pipelines.engine.files import digest, text_digest

SPANS_COLUMN = "spans"
_LINE = object()  # a record's key for its line in a JSONL file (no column name can equal it)
BATCH_DOCS = 2048
NEGATION_SETTINGS = ("none", "english")  # `CorpusConfig.negation` values that name no file
_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


@dataclass(frozen=True)
class CorpusConfig(Config):
    """How a corpus is read and which labels come with it."""

    text_column: str = option("text", "column (or JSON field) holding each document's text")
    label_column: str | None = option(None, "column with a class per document (e.g. a review's polarity), for feature labels")
    lexicon: str | None = option(None, "file of 'word<TAB>class' lines (a number as class: its sign), for feature labels")
    negation: str = option("none", "label negations (channel `negation`: a cue and the words after it up to the one it "
                                   "flips): 'english' (a built-in list of cues), a file of cue words one per line, or 'none'")
    context: str = option("none", "label each sentence's context (channel `context`): 'lexicon' (the --lexicon class of "
                                  "most words of it and the sentence before, negated words left out), 'column' (the "
                                  "document's --label-column class) or 'none'", choices=("none", "lexicon", "column"))
    held_out: float = option(0.05, "share of documents held out from training (chosen by document, seeded)", low=0.001, high=0.5)
    split_seed: int = seed_option("seed of the held-out choice")

    def check(self) -> None:
        if self.negation not in NEGATION_SETTINGS and not Path(self.negation).is_file():
            raise FileNotFoundError(f"CorpusConfig.negation (--negation) is 'none', 'english' or a file of cue words: "
                                    f"{self.negation!r} is neither, and no such file exists")
        needs = {"lexicon": ("lexicon", "--lexicon"), "column": ("label_column", "--label-column")}.get(self.context)
        if needs is not None and getattr(self, needs[0]) is None:
            raise ValueError(f"CorpusConfig.context {self.context!r} needs CorpusConfig.{needs[0]} ({needs[1]}): the "
                             "context's classes come from it")


@dataclass
class Documents:
    """A batch of documents: texts, and where present a class and labelled spans each."""

    texts: list[str]
    classes: list[str | None] | None = None
    spans: list[list[tuple[int, int, str]]] | None = None
    skipped: int = 0  # null or blank texts left out of this batch


def corpus_digest(source: str) -> str:
    """Content digest of a local corpus; a hub dataset is identified by its name."""
    if source.startswith("hf:"):
        return text_digest("hf", source)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"corpus {path} does not exist")
    return digest(path)


def iter_documents(source: str, cfg: CorpusConfig, batch_docs: int = BATCH_DOCS) -> Iterator[Documents]:
    """Stream the documents of `source` in batches (see the module docstring)."""
    records = _records(source, cfg)
    first = 0
    while True:
        chunk = list(itertools.islice(records, batch_docs))
        if not chunk:
            return
        yield _documents(chunk, cfg, source, first)
        first += len(chunk)


def _documents(chunk: list[dict], cfg: CorpusConfig, where: str, first: int) -> Documents:
    """The documents of `chunk`, the records `first`, `first + 1`, ... of the source."""
    texts, classes, spans, skipped = [], [], [], 0
    for index, record in enumerate(chunk, first):
        text = record.get(cfg.text_column)
        if text is None or (isinstance(text, float) and text != text):
            skipped += 1
            continue
        if not isinstance(text, str):
            raise ValueError(f"corpus {where}: column {cfg.text_column!r} holds {type(text).__name__} "
                             f"values such as {text!r}, not text")
        if not text.strip():
            skipped += 1
            continue
        texts.append(text)
        if cfg.label_column is not None:
            value = record.get(cfg.label_column)
            classes.append(None if value is None or value != value else str(value))
        raw = record.get(SPANS_COLUMN)
        place = f"line {record[_LINE]}" if _LINE in record else f"record {index + 1}"
        spans.append(_spans(raw, len(text), f"corpus {where}, {place}") if raw is not None else [])
    has_spans = any(spans)
    return Documents(texts, classes if cfg.label_column is not None else None,
                     spans if has_spans else None, skipped)


def _spans(raw, length: int, where: str) -> list[tuple[int, int, str]]:
    """A document's labelled spans, each a `{start, end, label}` struct or a `[start, end,
    label]` list of character offsets into its text of `length` characters."""
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"{where}: {SPANS_COLUMN!r} must be a list of spans, not {raw!r}")
    out = []
    for span in raw:
        if isinstance(span, dict):
            span = [span.get(key) for key in ("start", "end", "label")]
        ok = isinstance(span, (list, tuple)) and len(span) == 3
        if ok:
            start, end, label = span
            ok = (all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (start, end))
                  and 0 <= start <= end <= length and isinstance(label, str) and label != "")
        if not ok:
            raise ValueError(f"{where}: bad span {span!r}: a span is [start, end, label] or {{start, end, label}}, "
                             f"whole character offsets with 0 <= start <= end <= {length} (the text's length) "
                             "and a non-empty label")
        out.append((int(start), int(end), label))
    return out


def _records(source: str, cfg: CorpusConfig) -> Iterator[dict]:
    """Each document of the source as a dict of its columns."""
    if source.startswith("hf:"):
        yield from _hub_records(source[3:])
        return
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"corpus {path} does not exist")
    columns = [c for c in (cfg.text_column, cfg.label_column) if c]
    if path.is_dir() and (path / "dataset_info.json").is_file():
        yield from _datasets_records(path, columns)
    elif path.is_dir() or path.suffix == ".parquet":
        yield from _parquet_records(path, columns)
    else:
        yield from _text_file_records(path, cfg)


def _parquet_records(path: Path, columns: list[str]) -> Iterator[dict]:
    files = sorted(p for p in path.rglob("*.parquet") if not p.name.startswith(".")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"corpus {path} holds no Parquet files")
    for file in files:
        try:
            handle = pq.ParquetFile(file)
        except (pa.ArrowInvalid, OSError) as err:
            raise ValueError(f"corpus {file} is not a readable Parquet file: {err}") from None
        names = handle.schema_arrow.names
        missing = [c for c in columns if c not in names]
        if missing:
            raise ValueError(f"corpus {file} has no column {missing[0]!r}; its columns are {names}")
        # checked per file, so that the error names the file of a folder that holds no text
        kind = handle.schema_arrow.field(columns[0]).type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)
                or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
            raise ValueError(f"corpus {file}: column {columns[0]!r} holds {kind} values, not text")
        wanted = columns + ([SPANS_COLUMN] if SPANS_COLUMN in names else [])
        for batch in handle.iter_batches(batch_size=BATCH_DOCS, columns=wanted):
            yield from batch.to_pylist()


def _datasets_records(path: Path, columns: list[str]) -> Iterator[dict]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise ValueError(f"corpus {path} has no column {missing[0]!r}; its columns are {ds.column_names}")
    for start in range(0, len(ds), BATCH_DOCS):
        batch = ds[start : start + BATCH_DOCS]
        names = list(batch)
        yield from (dict(zip(names, values)) for values in zip(*batch.values()))


def _hub_records(spec: str) -> Iterator[dict]:
    """`name[:split]` streamed through `datasets`; offline only a cached dataset works."""
    import datasets

    name, _, split = spec.partition(":")
    try:
        stream = datasets.load_dataset(name, split=split or "train", streaming=True)
        yield from stream
    except (FileNotFoundError, ConnectionError, ValueError, OSError) as err:
        raise ValueError(
            f"cannot read the hub dataset hf:{spec} ({type(err).__name__}: {str(err).splitlines()[0]}). "
            "Without a network only datasets in the local cache work (HF_DATASETS_OFFLINE is set); "
            "save it once with `datasets` or pass a local file"
        ) from None


def _open_text(path: Path):
    opener = _OPENERS.get(path.suffix)
    if path.suffix == ".zst":
        import zstandard

        raw = zstandard.ZstdDecompressor().stream_reader(path.open("rb"))
        return io.TextIOWrapper(raw, encoding="utf-8")
    if opener is not None:
        return opener(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _inner_suffix(path: Path) -> str:
    """`.jsonl` for `x.jsonl.gz`, `.txt` for `x.txt`."""
    if path.suffix in (*_OPENERS, ".zst"):
        return Path(path.stem).suffix
    return path.suffix


def _text_file_records(path: Path, cfg: CorpusConfig) -> Iterator[dict]:
    json_lines = _inner_suffix(path) in (".jsonl", ".json", ".ndjson")
    try:
        with _open_text(path) as handle:
            if json_lines:
                wanted = [c for c in (cfg.text_column, cfg.label_column) if c]
                found: set[str] = set()
                first_fields: list[str] | None = None
                for number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"corpus {path}, line {number}: not JSON ({err.msg})") from None
                    if not isinstance(record, dict):
                        raise ValueError(f"corpus {path}, line {number}: not a JSON object but a "
                                         f"{type(record).__name__}")
                    if first_fields is None:
                        first_fields = list(record)
                    found.update(c for c in wanted if c in record)
                    record[_LINE] = number  # where its spans' errors point
                    yield record
                # a field no line has is a misspelt column, not a corpus of null texts
                missing = [c for c in wanted if c not in found]
                if first_fields is not None and missing:
                    raise ValueError(f"corpus {path} has no field {missing[0]!r} in any line; "
                                     f"the fields of its first line are {first_fields}")
                return
            paragraph: list[str] = []
            for line in handle:
                if line.strip():
                    paragraph.append(line.rstrip("\n"))
                elif paragraph:
                    yield {cfg.text_column: "\n".join(paragraph)}
                    paragraph = []
            if paragraph:
                yield {cfg.text_column: "\n".join(paragraph)}
    except UnicodeDecodeError as err:
        raise ValueError(f"corpus {path} is not UTF-8 text: byte {err.object[err.start:err.start + 1]!r} "
                         f"at offset {err.start} of a block cannot be decoded") from None
    except (EOFError, OSError, lzma.LZMAError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise ValueError(f"corpus {path} cannot be read: {err}") from None
