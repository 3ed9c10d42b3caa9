"""Activation shards on disk: cached once in one model pass, read back shuffled per point.

Layout of a cache directory:

    manifest.json                      points, token count, rows per shard, fingerprint
    layer0_resid_mid/shard-00000.safetensors   one tensor "acts" [rows, d_model]
    ...

Every point gets the same number of rows per shard and the same within-shard shuffle, so
row i of a shard is the same token at every point. The whole directory is written under a
temporary name and renamed, so a cache that exists is complete. Memory while writing is
bounded by about `shard_tokens + batch_seqs * n_ctx` rows per point, and while reading by
the shuffle buffer, whatever the number of tokens.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from sae_lens.training.mixing_buffer import mixing_buffer
from tqdm.auto import tqdm
from transformer_lens import HookedTransformer

from sae.activations import iter_activations
from sae.config import CACHE_DTYPES
from sae.sites import Point, point_name

MANIFEST = "manifest.json"
SHARD_NAME = "shard-{:05d}.safetensors"


@dataclass(frozen=True)
class ActivationCache:
    """A complete cache directory; `points` are those whose shards are still on disk."""

    directory: Path
    points: tuple[Point, ...]
    n_tokens: int  # rows per point
    shard_rows: tuple[int, ...]
    fingerprint: str

    @classmethod
    def open(cls, directory: str | Path) -> "ActivationCache | None":
        """The cache at `directory`, or None when there is none."""
        directory = Path(directory)
        manifest = directory / MANIFEST
        if not manifest.is_file():
            return None
        data = json.loads(manifest.read_text())
        listed = [(int(layer), site) for layer, site in data["points"]]
        points = tuple(point for point in listed if (directory / point_name(point)).is_dir())
        return cls(directory, points, data["n_tokens"], tuple(data["shard_rows"]), data["fingerprint"])

    def shard_path(self, point: Point, index: int) -> Path:
        return self.directory / point_name(point) / SHARD_NAME.format(index)

    def batches(self, point: Point, batch_size: int, buffer_tokens: int, seed: int = 0) -> Iterator[torch.Tensor]:
        """One pass over the point's rows in shuffled batches `[batch_size, d_model]` (float32).

        Shards are read in a random order into a mixing buffer of `buffer_tokens` rows that
        is reshuffled as it refills, so a batch mixes tokens from many sequences. Exactly
        `n_tokens // batch_size` batches come out.
        """
        if point not in self.points:
            raise ValueError(f"the cache at {self.directory} holds no activations for {point_name(point)}")
        order = torch.randperm(len(self.shard_rows), generator=torch.Generator().manual_seed(seed))
        shards = (load_file(self.shard_path(point, int(i)))["acts"].float() for i in order)
        return mixing_buffer(max(buffer_tokens, batch_size), batch_size, shards)

    def drop(self, point: Point) -> None:
        """Delete a point's shards (renamed away first, so a crash never leaves half of them)."""
        folder = self.directory / point_name(point)
        trash = folder.with_name(f".{folder.name}.{uuid.uuid4().hex}.deleting")
        folder.rename(trash)
        shutil.rmtree(trash)


def weights_digest(model: HookedTransformer) -> str:
    """A hash of the model's weights: which model an output was computed from."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def fingerprint(model: HookedTransformer, tokens: torch.Tensor, keep: torch.Tensor, **settings) -> str:
    """A hash of the model weights, tokens, kept positions and settings the cache came from."""
    digest = hashlib.sha256(weights_digest(model).encode())
    digest.update(tokens.cpu().numpy().tobytes())
    digest.update(keep.cpu().numpy().tobytes())
    digest.update(json.dumps(settings, sort_keys=True).encode())
    return digest.hexdigest()


@torch.no_grad()
def write_cache(
    model: HookedTransformer,
    tokens: torch.Tensor,
    keep: torch.Tensor,
    points: list[Point],
    directory: str | Path,
    n_tokens: int,
    shard_tokens: int = 65536,
    batch_seqs: int = 32,
    dtype: str = "float32",
    seed: int = 0,
    fingerprint: str = "",
) -> ActivationCache:
    """Run the model over `tokens` once and store the first `n_tokens` kept rows of every point.

    tokens, keep: `[n_seq, n_ctx]`. Replaces any cache at `directory`. Raises ValueError
    when fewer than `n_tokens` positions are kept.
    """
    available = int(keep.sum())
    if available < n_tokens:
        raise ValueError(f"corpus too small: {available} usable tokens, {n_tokens} requested")
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"unknown cache dtype {dtype!r}; choose from {', '.join(CACHE_DTYPES)}")
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.{uuid.uuid4().hex}.tmp")
    for point in points:
        (tmp / point_name(point)).mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    pending: dict[Point, list[torch.Tensor]] = {p: [] for p in points}
    shard_rows: list[int] = []
    n_pending = 0
    n_seen = 0
    bar = tqdm(total=n_tokens, desc="caching activations", unit="tok")
    try:
        for found in iter_activations(model, tokens, points, keep, batch_seqs):
            take = min(n_tokens - n_seen, next(iter(found.values())).shape[0])
            for point in points:
                pending[point].append(found[point][:take].to("cpu", getattr(torch, dtype)))
            n_pending += take
            n_seen += take
            bar.update(take)
            while n_pending >= shard_tokens or (n_seen == n_tokens and n_pending):
                rows = min(shard_tokens, n_pending)
                _write_shard(tmp, pending, len(shard_rows), rows, generator)
                shard_rows.append(rows)
                n_pending -= rows
            if n_seen == n_tokens:
                break
        manifest = {
            "points": [list(p) for p in points],
            "n_tokens": n_tokens,
            "shard_rows": shard_rows,
            "dtype": dtype,
            "fingerprint": fingerprint,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return ActivationCache.open(directory)


def _write_shard(folder: Path, pending: dict[Point, list[torch.Tensor]], index: int, rows: int, generator) -> None:
    """Write the first `rows` pending rows of every point, all shuffled by one permutation."""
    perm = torch.randperm(rows, generator=generator)
    for point, chunks in pending.items():
        acts = torch.cat(chunks)
        path = folder / point_name(point) / SHARD_NAME.format(index)
        save_file({"acts": acts[:rows][perm].contiguous()}, path)
        chunks[:] = [acts[rows:]]
