"""Activations streamed from the model into shuffle buffers, one per (layer, site) point.

One model pass over a group of rows fills a buffer per point with the kept tokens'
activations (`sae.activations.iter_activations`, BOS left out); the buffer is shuffled by
one permutation shared by every point and drained in batches of `batch_size` tokens, from
which every SAE takes its step; then the next group of rows fills it again. No activation
ever touches the disk, and memory is bounded by `buffer_tokens` rows per point whatever the
number of training tokens.

The stream is a pure function of the seed and its position (which fill, where that fill's
rows start, how many of its batches were used), so a training run resumed from a
checkpoint sees exactly the batches an uninterrupted run would have seen: resuming refills
the current buffer from the same rows and skips the batches already used. Rows are visited
in a fresh seeded permutation per epoch; tokens of a fill that do not make a whole batch
are left out. Given the number of batches a run takes, the last fill reads only the rows
those batches need (as if every row but its first token were kept; a short fill is followed
by another), so a short run does not pay for a whole buffer's model pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from sae.activations import autocast, iter_activations
from circuits.sites import Point

if TYPE_CHECKING:  # annotations only: importing TransformerLens takes seconds
    from transformer_lens import HookedTransformer


class Rows(Protocol):
    """Packed token rows (`pipelines.data.tokens.TokenRows` is one)."""

    def __len__(self) -> int: ...

    def batch(self, rows) -> torch.Tensor: ...  # LongTensor [n, n_ctx]

    def keep(self, tokens: torch.Tensor) -> torch.Tensor: ...  # bool [n, n_ctx]


@dataclass
class StreamPosition:
    """Where a stream stands: enough to resume it exactly."""

    fill: int = 0  # index of the current fill
    cursor: int = 0  # position in the row order where the current fill's rows start
    offset: int = 0  # batches of the current fill already handed out
    before: int = 0  # batches handed out by the earlier fills

    def to_json(self) -> dict:
        return {"fill": self.fill, "cursor": self.cursor, "offset": self.offset, "before": self.before}


class ActivationStream:
    """Batches `{point: [batch_size, d_model]}` for every point, from one model pass per fill."""

    def __init__(self, model: HookedTransformer, rows: Rows, points: list[Point], buffer_tokens: int,
                 batch_size: int, seed: int, model_batch_rows: int = 32, dtype: torch.dtype = torch.float32,
                 precision: str = "none", total_batches: int | None = None, pool: Executor | None = None):
        """`pool`: a fill's model batches run on its threads (each batch's activations go to
        their own places in the buffers, so the order in which batches finish does not matter)."""
        n_ctx = rows.batch(slice(0, 1)).shape[1]
        self.model, self.rows, self.points, self.n_ctx = model, rows, points, n_ctx
        self.total_batches = total_batches
        self.rows_per_fill = max(1, buffer_tokens // n_ctx)
        if self.rows_per_fill * (n_ctx - 1) < batch_size:
            raise ValueError(f"a buffer of {buffer_tokens} tokens holds less than one batch of {batch_size}")
        self.batch_size, self.seed = batch_size, seed
        self.model_batch_rows, self.dtype, self.precision = model_batch_rows, dtype, precision
        self.pool = pool
        self.position = StreamPosition()
        self._buffers: dict[Point, torch.Tensor] | None = None  # [rows_per_fill * n_ctx, d_model] per point

    def state(self) -> dict:
        """Where the next batch comes from, JSON-able (`restore` takes it back)."""
        return self.position.to_json()

    def restore(self, state: dict) -> None:
        self.position = StreamPosition(**state)

    def _row_order(self, start: int, count: int) -> torch.Tensor:
        """Row indices at positions `start .. start + count` of the endless epoch order."""
        n = len(self.rows)
        positions = torch.arange(start, start + count)
        out = torch.empty(count, dtype=torch.long)
        for epoch in (positions // n).unique().tolist():
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
            sel = positions // n == epoch
            out[sel] = perm[positions[sel] % n]
        return out

    def _fill_rows(self) -> int:
        """Rows of the current fill: a whole buffer, or fewer when the run needs fewer batches."""
        if self.total_batches is None:
            return self.rows_per_fill
        needed = max(1, self.total_batches - self.position.before) * self.batch_size
        return min(self.rows_per_fill, -(-needed // (self.n_ctx - 1)))

    @torch.no_grad()
    def _fill(self, cursor: int, n_rows: int) -> dict[Point, torch.Tensor]:
        """The activations of the kept tokens of one fill's rows, shuffled alike at every point.

        Each model batch's activations go straight to their shuffled places in one buffer per
        point, allocated once and reused by every fill: memory stays at one buffer (collecting,
        concatenating and permuting would hold up to three and let the heap grow from fill to
        fill).
        """
        order = self._row_order(cursor, n_rows).sort().values  # file order: faster reads
        tokens = self.rows.batch(order.numpy())
        keep = self.rows.keep(tokens)
        n = int(keep.sum())
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 104729 + self.position.fill))
        where = torch.empty_like(perm)
        where[perm] = torch.arange(n)  # kept token i lands at where[i]: the buffer is kept[perm]
        if self._buffers is None:
            d = self.model.cfg.d_model
            self._buffers = {p: torch.empty(self.rows_per_fill * self.n_ctx, d, dtype=self.dtype,
                                            device=self.model.cfg.device) for p in self.points}
        step = self.model_batch_rows
        # where each model batch's kept tokens start among the fill's kept tokens
        starts = torch.cat([torch.zeros(1, dtype=torch.long), keep.sum(1).cumsum(0)])[::step].tolist()

        def pass_rows(first: int, start: int) -> None:
            with autocast(self.precision, self.model.cfg.device):  # per thread: autocast is thread-local
                for found in iter_activations(self.model, tokens[first : first + step], self.points,
                                              keep[first : first + step], step):
                    index = where[start : start + next(iter(found.values())).shape[0]].to(self.model.cfg.device)
                    for point, acts in found.items():
                        self._buffers[point].index_copy_(0, index, acts.to(self.dtype))

        firsts = range(0, len(tokens), step)
        list((self.pool.map if self.pool is not None else map)(pass_rows, firsts, starts))
        return {p: b[:n] for p, b in self._buffers.items()}

    def __iter__(self) -> Iterator[dict[Point, torch.Tensor]]:
        """Endless batches from the current position on; `self.position` always says where
        the next batch comes from."""
        while True:
            n_rows = self._fill_rows()
            buffers = self._fill(self.position.cursor, n_rows)
            n_batches = next(iter(buffers.values())).shape[0] // self.batch_size
            while self.position.offset < n_batches:
                s = slice(self.position.offset * self.batch_size, (self.position.offset + 1) * self.batch_size)
                self.position.offset += 1
                # copies: the next fill overwrites the buffers while the caller may hold a batch
                yield {p: b[s].clone() for p, b in buffers.items()}
            position = self.position
            self.position = StreamPosition(position.fill + 1, position.cursor + n_rows, 0, position.before + n_batches)
