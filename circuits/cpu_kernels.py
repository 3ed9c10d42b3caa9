"""Loops that torch runs slowly on a CPU, compiled by numba: each touches every entry once.

- `row_top_k`: the k largest entries of each row. torch's CPU `topk` copies every row and
  partitions it, which costs several times a single pass: at an SAE's training batch it took
  more of a step than the encoder's matrix product (`benchmarks/bench_topk.py` measures both).
  One pass keeps the k largest values seen so far in a small sorted buffer; an entry smaller
  than the buffer's least (almost all of them) costs one comparison.
- `scatter_rows`: weighted rows added into chosen rows of an output, the sparse products of
  the SAE step's backward. torch's sparse product first sorts the nonzeros and then sums them;
  the loop adds each weighted row in place (`benchmarks/bench_sae_step.py` times the step).

Imported only where a CPU computation needs it: numba takes a moment to import, and compiles a
kernel on its first call (then reads it from its on-disk cache).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def row_top_k(x: np.ndarray, k: int, out: np.ndarray, unsure: np.ndarray) -> None:
    """For each row of x `[rows, n]` (float32 or float64), the columns of its k largest
    values into out `[rows, k]` (int64, in no order), for 1 <= k <= n.

    `unsure[r]` `[rows]` (bool) is set where the row's answer is not unique or not what
    torch's `topk` would name: a value equal to the k-th largest was left out (a tie at the
    cut-off, whose winners are torch's choice), or the row holds a NaN (torch ranks NaN
    above everything; here it would be skipped). Those rows' `out` is to be replaced.
    """
    rows, n = x.shape
    best = np.empty(k, x.dtype)  # the k largest so far, descending
    where = np.empty(k, np.int64)
    for r in range(rows):
        row = x[r]
        nan = False
        for j in range(k):
            value = row[j]
            nan |= value != value
            i = j
            while i > 0 and best[i - 1] < value:
                best[i], where[i] = best[i - 1], where[i - 1]
                i -= 1
            best[i], where[i] = value, j
        least = best[k - 1]
        # The largest value pushed out of the buffer: were it equal to the final k-th largest,
        # the cut-off falls inside a tie. A value never let in was below the least of its
        # time, and the least only grows, so it is below the final one.
        dropped = -np.inf
        for j in range(k, n):
            value = row[j]
            if value < least:
                continue
            if value != value:
                nan = True
                break
            dropped = max(dropped, least)
            i = k - 1
            while i > 0 and best[i - 1] < value:
                best[i], where[i] = best[i - 1], where[i - 1]
                i -= 1
            best[i], where[i] = value, j
            least = best[k - 1]
        unsure[r] = nan or dropped == least
        out[r, :] = where


@numba.njit(cache=True, nogil=True)
def scatter_rows(indices: np.ndarray, weights: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """`out[indices[b, j]] += weights[b, j] * rows[b]` for every (b, j), in order of b then j.

    indices `[batch, m]` (int64), weights `[batch, m]`, rows `[batch, d]`, out `[n_out, d]`
    (zeros to get the plain sum), one float dtype for the last three.
    """
    batch, m = indices.shape
    for b in range(batch):
        row = rows[b]
        for j in range(m):
            target = out[indices[b, j]]
            weight = weights[b, j]
            for c in range(row.shape[0]):
                target[c] += weight * row[c]
