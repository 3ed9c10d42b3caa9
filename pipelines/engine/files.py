"""Atomic writes and content digests, the one implementation of each.

Everything a stage writes goes through `atomic_file` or `atomic_dir`: the content is written
under a temporary name in the same folder and renamed into place, so a reader (or a rerun
after a crash or Ctrl-C) sees either the old complete output or the new complete output,
never half of one. Temporary names start with a dot and end in `.tmp`; `clean_temporaries`
removes those an earlier killed process left behind.

`digest` hashes content, never how a path is spelled: a file's bytes, or a folder's files
(their names relative to the folder, and their bytes). Hashing gigabytes on every command
would be slow, so each file's digest is cached by its absolute path, size, inode and
modification time, in memory and in a small JSON file under the user's cache folder.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TMP_SUFFIX = ".tmp"
_CHUNK = 1 << 22
_MAX_CACHED = 20000
_WRITE_EVERY = 2.0  # seconds between writes of the digest cache's file


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success it replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text(path: str | Path, text: str) -> Path:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | Path, data) -> Path:
    return write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_text_lines(path: str | Path, name: str) -> list[str]:
    """The lines of a user's UTF-8 text file, without the byte-order mark some editors write
    first (it would stick to the first line's first word). `name` names the file in errors:
    FileNotFoundError when it is absent, ValueError when it is not UTF-8 (a Latin-1 file)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{name} {path} does not exist")
    try:
        return path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"{name} {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}): "
                         "save it as UTF-8") from None


def read_json(path: str | Path):
    """The JSON in `path`, or None when the file is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder; on success it replaces the folder `path`.

    The old folder is first renamed away and only then deleted, so at every moment `path`
    is either the complete old folder or the complete new one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if path.exists():
            old = _tmp_name(path)
            path.rename(old)
        tmp.rename(path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove(path: str | Path) -> None:
    """Delete a file or folder; a folder is renamed away first so it never lies half-deleted."""
    path = Path(path)
    if path.is_dir():
        trash = _tmp_name(path)
        path.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    elif path.exists():
        path.unlink()


def clean_temporaries(folder: str | Path) -> int:
    """Delete the temporary files and folders that killed processes left under `folder`."""
    count = 0
    for tmp in Path(folder).rglob(f".*{TMP_SUFFIX}"):
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        count += 1
    return count


# ------------------------------------------------------------------ digests


class _DigestCache:
    """File digests by (path, size, inode, mtime), kept in memory and in a JSON file.

    New digests reach the file at most every `_WRITE_EVERY` seconds and at the interpreter's
    exit: the file holds up to `_MAX_CACHED` digests (a few MB), and written once per new digest
    it would slow the start of a stage that reads many tables. A process killed
    before its exit loses only its last few seconds' digests: they are hashed again."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[str, str] | None = None
        self.unwritten: dict[str, str] = {}
        self.written = -float("inf")  # time.monotonic() of the last write

    @property
    def file(self) -> Path:
        root = os.environ.get("BILINEAR_CIRCUITS_CACHE") or os.environ.get("XDG_CACHE_HOME")
        base = Path(root) if root else Path.home() / ".cache"
        return base / "bilinear-circuits" / "digests.json"

    def get(self, key: str) -> str | None:
        with self.lock:
            if self.entries is None:
                self.entries = read_json(self.file) or {}
            return self.entries.get(key)

    def put(self, key: str, value: str) -> None:
        with self.lock:
            if self.entries is None:
                self.entries = {}
            self.entries[key] = self.unwritten[key] = value
            if time.monotonic() - self.written >= _WRITE_EVERY:
                self._write()

    def flush(self) -> None:
        """Write the digests not yet in the file."""
        with self.lock:
            if self.unwritten:
                self._write()

    def _write(self) -> None:
        # merged into what is on disk now: other processes' digests written meanwhile stay
        entries = {**(read_json(self.file) or {}), **self.unwritten}
        for old in list(entries)[: max(0, len(entries) - _MAX_CACHED)]:
            del entries[old]
        self.unwritten, self.written = {}, time.monotonic()
        try:
            write_json(self.file, entries)
        except OSError:
            pass  # a read-only home only costs rehashing next time


_CACHE = _DigestCache()
atexit.register(_CACHE.flush)


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes, cached by its size, inode and modification time."""
    path = Path(path).resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_ino}|{stat.st_mtime_ns}"
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    value = digest.hexdigest()
    _CACHE.put(key, value)
    return value


def digest(path: str | Path, ignore: tuple[str, ...] = ()) -> str:
    """Content digest of a file or a folder (its files' relative names and bytes).

    Hidden files (names starting with a dot: temporaries, locks) and names in `ignore` are
    left out, so a stamp written inside a folder does not change the folder's digest.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_file():
        return file_digest(path)
    combined = hashlib.sha256()
    for child in sorted(path.rglob("*")):
        relative = child.relative_to(path)
        if not child.is_file() or any(part.startswith(".") for part in relative.parts):
            continue
        if child.name in ignore:
            continue
        combined.update(relative.as_posix().encode())
        combined.update(file_digest(child).encode())
    return combined.hexdigest()


def text_digest(*parts) -> str:
    """sha256 of JSON-serialised values (configs, names of hub datasets)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def readable_name(text: str, *parts, width: int = 40, digits: int = 10) -> str:
    """A file name that reads as `text` and cannot collide: its lower-case ASCII letters and digits
    in dash-joined runs (at most `width` characters, `x` when there are none), a dash, and the
    first `digits` hex digits of the digest of `text` and `parts`. Texts differing in anything
    (case, punctuation, what lies past `width`, non-Latin letters) get different names, and no
    name equals a fixed one without a digest (`graph-metadata`, `features`)."""
    words = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:width].strip("-") or "x"
    return f"{words}-{text_digest(text, *parts)[:digits]}"
