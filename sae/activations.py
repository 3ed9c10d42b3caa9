"""Collect activations at several (layer, site) points with one model pass per batch.

The model runs (`circuits.forward`) only as deep as the deepest point needs, so neither
later blocks nor the unembedding are computed. Positions can be left out (BOS, padding, or
any mask); what comes back is token-level: one row per kept position, rows ordered by
sequence and then by position.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from circuits import forward
from circuits.sites import Point, check_points

if TYPE_CHECKING:  # annotations only: importing TransformerLens takes seconds
    from transformer_lens import HookedTransformer


PRECISIONS = ("none", "bf16", "auto")  # of `autocast`


def native_bf16(device: str) -> bool:
    """Whether `device` multiplies bfloat16 matrices in hardware: a CUDA GPU of compute
    capability 8.0 or more, or a CPU with AVX512-BF16 or AMX tiles. Elsewhere bfloat16
    products are emulated, slower than float32 (oneDNN and `torch.cuda.is_bf16_supported()`
    accept emulation, so neither is asked)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type != "cpu":
        return False
    # torch.cpu's feature checks are private: one that is absent answers no
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check is not None and bool(check()) for check in checks)


def resolve_precision(kind: str, device: str) -> str:
    """What `kind` ("none", "bf16" or "auto": bf16 where `native_bf16`) means on `device`."""
    if kind not in PRECISIONS:
        raise ValueError(f"unknown precision {kind!r}; choose from {', '.join(PRECISIONS)}")
    return ("bf16" if native_bf16(device) else "none") if kind == "auto" else kind


def autocast(kind: str, device: str):
    """A bfloat16 autocast context for model passes on `device` when `kind` resolves to
    "bf16" (`resolve_precision`), else nothing."""
    if resolve_precision(kind, device) == "bf16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def check_tokens(tokens: torch.Tensor, model: HookedTransformer | None = None) -> None:
    """Raise ValueError unless `tokens` is a LongTensor `[n_seq, n_ctx]` the model accepts."""
    if tokens.ndim != 2 or tokens.dtype != torch.long:
        raise ValueError(f"tokens must be a LongTensor [n_seq, n_ctx], got {tokens.dtype} {tuple(tokens.shape)}")
    if model is None:
        return
    if tokens.shape[1] > model.cfg.n_ctx:
        raise ValueError(f"rows of {tokens.shape[1]} tokens exceed the model's context of {model.cfg.n_ctx}")
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= model.cfg.d_vocab):
        raise ValueError(f"token ids must lie in [0, {model.cfg.d_vocab}) for this model")


@torch.no_grad()
def iter_activations(
    model: HookedTransformer,
    tokens: torch.Tensor,
    points: list[Point],
    keep: torch.Tensor | None = None,
    batch_seqs: int = 32,
) -> Iterator[dict[Point, torch.Tensor]]:
    """For each batch of `batch_seqs` rows, the kept activations at every point.

    tokens: `[n_seq, n_ctx]`; keep: `[n_seq, n_ctx]` bool (default all). Yields
    `{point: [n_kept_in_batch, d_model]}` on the model's device; batches with nothing kept
    are skipped.
    """
    check_points(model, points)
    check_tokens(tokens, model)
    if keep is None:
        keep = torch.ones_like(tokens, dtype=torch.bool)
    if keep.shape != tokens.shape:
        raise ValueError(f"keep has shape {tuple(keep.shape)} but tokens have {tuple(tokens.shape)}")
    device = model.cfg.device
    stop = max(layer for layer, _ in points) + 1
    for start in range(0, tokens.shape[0], batch_seqs):
        rows = keep[start : start + batch_seqs].to(device)
        if not rows.any():
            continue
        _, found = forward.blocks(model, forward.embed(model, tokens[start : start + batch_seqs].to(device)), 0, stop,
                                  points)
        yield {point: act[rows] for point, act in found.items()}  # boolean indexing copies: [n_kept, d_model]
