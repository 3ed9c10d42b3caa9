"""The bilinear LM's forward pass as plain tensor functions on a TransformerLens model's weights.

TransformerLens runs every block through hook points, per-head einsums and a hand-written
attention; for our one architecture (RMS norms, rotary attention, a bilinear MLP) the same
math in a few fused products is measurably faster on a CPU (`benchmarks/bench_lm.py` prints
both). LM training, the held-out loss, activation collection, the verdicts' token cache and
their model-run ablations use it; the SAEs' spliced-in loss and the attribution graphs keep
TransformerLens's hooks. The weights stay the model's own parameters, so gradients reach
them as usual.

Conventions are TransformerLens 3.9's, checked against it in `tests/test_forward.py`:
`rms(x) = x / sqrt(mean(x^2) + eps) * w`, rotary over the whole head with the two halves
paired (not adjacent entries), scores divided by `sqrt(d_head)`, a causal mask, and the
gated MLP `W_out^T ((W_gate^T x) * (W_in^T x) + b_in) + b_out`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from circuits.sites import MLP_IN, MLP_OUT, RESID_MID, Point

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer


def check_architecture(model: HookedTransformer) -> None:
    """Raise ValueError unless `model` is a bilinear LM of the shape this module computes."""
    cfg = model.cfg
    wanted = {
        "normalization_type": "RMS", "positional_embedding_type": "rotary", "gated_mlp": True,
        "act_fn": "identity", "rotary_dim": cfg.d_head, "use_attn_scale": True, "attn_scale": cfg.d_head ** 0.5,
        "attention_dir": "causal", "attn_scores_soft_cap": -1.0, "output_logits_soft_cap": -1.0,
        "n_key_value_heads": None, "clip_qkv": None, "original_architecture": None,
        "num_experts": None, "d_vocab_out": cfg.d_vocab,
    }
    wanted.update(dict.fromkeys((
        "rotary_adjacent_pairs", "attn_only", "parallel_attn_mlp", "use_local_attn", "use_logn_attn",
        "use_qk_norm", "scale_attn_by_inverse_layer_idx", "post_embedding_ln", "final_rms",
        "use_normalization_before_and_after", "use_attention_sinks"), False))
    for name, value in wanted.items():
        if getattr(cfg, name, value) != value:
            raise ValueError(f"not a bilinear LM of this toolkit's architecture: {name}={getattr(cfg, name)!r}, "
                             f"need {value!r}")


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * gain` over the last axis. x: `[..., d_model]`."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding with the halves of each head paired. x: `[batch, heads, pos, d_head]`;
    cos, sin: `[pos, d_head]`."""
    half = x.shape[-1] // 2
    # the halves swapped by one roll, the sign moved onto sin: the same values bit for bit as
    # cat([-x2, x1]) * sin, with one pass over x fewer each way
    signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return x * cos + x.roll(half, -1) * signed


def _project(model: HookedTransformer, layer: int, h: torch.Tensor, positions: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block `layer`'s queries, keys and values `[batch, heads, pos, d_head]` from its normalised
    input `h [batch, pos, d_model]`, queries and keys rotated for their positions: 0 to pos - 1,
    or `positions [batch, pos]` of each row (-1: padding, rotated as position 0)."""
    attn = model.blocks[layer].attn
    batch, pos, _ = h.shape
    n_heads, d_model, d_head = attn.W_Q.shape
    # one product for queries, keys and values: [d_model, 3 * heads * d_head]
    w = torch.stack([attn.W_Q, attn.W_K, attn.W_V]).permute(2, 0, 1, 3).reshape(d_model, -1)
    b = torch.stack([attn.b_Q, attn.b_K, attn.b_V]).reshape(-1)
    q, k, v = F.linear(h, w.t(), b).view(batch, pos, 3, n_heads, d_head).permute(2, 0, 3, 1, 4)
    if positions is None:
        cos, sin = attn.rotary_cos[:pos], attn.rotary_sin[:pos]
    else:
        at = positions.clamp_min(0)
        cos, sin = attn.rotary_cos[at][:, None], attn.rotary_sin[at][:, None]
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def _attend(model: HookedTransformer, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """Block `layer`'s attention output `[batch, pos, d_model]` of queries `q` over keys `k` and
    values `v` (`_project`), causal, or where `mask [batch, 1, pos, keys]` says."""
    attn = model.blocks[layer].attn
    batch, _, pos, _ = q.shape
    d_model = attn.W_O.shape[-1]
    causal = mask is None
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        # a CPU's fused attention, its backward pass above all, is slower in bfloat16 than in
        # float32: only the products around it gain
        with torch.autocast("cpu", enabled=False):
            z = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal)
    else:
        z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    return F.linear(z.transpose(1, 2).reshape(batch, pos, -1), attn.W_O.reshape(-1, d_model).t(), attn.b_O)


def attention(model: HookedTransformer, layer: int, h: torch.Tensor, kept: dict | None = None) -> torch.Tensor:
    """Block `layer`'s attention output `[batch, pos, d_model]` from its normalised input `h`;
    `kept[layer]` becomes its keys and values (`attention_at` reads them)."""
    q, k, v = _project(model, layer, h)
    if kept is not None:
        kept[layer] = (k, v)
    return _attend(model, layer, q, k, v)


def attention_at(model: HookedTransformer, layer: int, h: torch.Tensor, positions: torch.Tensor,
                 keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Block `layer`'s attention output `[batch, pos, d_model]` at `positions [batch, pos]` of
    each row (-1: padding, whose output means nothing) from their normalised input `h`, given
    the row's keys and values `[batch, heads, P, d_head]` at the other positions (`attention`'s
    `kept`): those at `positions` are replaced by h's, and each position reads the keys at
    and before it."""
    q, k, v = _project(model, layer, h, positions)
    keys, values = keys.clone(), values.clone()
    row, slot = (positions >= 0).nonzero(as_tuple=True)
    keys[row, :, positions[row, slot]] = k[row, :, slot].to(keys.dtype)
    values[row, :, positions[row, slot]] = v[row, :, slot].to(values.dtype)
    mask = torch.arange(keys.shape[2], device=h.device) <= positions.clamp_min(0)[:, None, :, None]
    return _attend(model, layer, q, keys, values, mask)


def mlp(model: HookedTransformer, layer: int, x: torch.Tensor) -> torch.Tensor:
    """Block `layer`'s bilinear MLP output `[..., d_model]` from its input `x` (after the norm's gain)."""
    m = model.blocks[layer].mlp
    product = (x @ m.W_gate) * (x @ m.W_in)
    # b_in in the product's precision: under autocast a float32 b_in made the [..., d_mlp] sum a
    # float32 copy, cast back for W_out (the demo's LM step 2.5% faster); in float32 a no-op
    return F.linear(product + m.b_in.to(product.dtype), m.W_out.t(), m.b_out)


def embed(model: HookedTransformer, tokens: torch.Tensor) -> torch.Tensor:
    """The residual stream `[batch, pos, d_model]` entering block 0 for `tokens` `[batch, pos]`
    (`blocks`, through which every pass goes, checks the architecture)."""
    return model.embed.W_E[tokens]


def blocks(model: HookedTransformer, x: torch.Tensor, start: int, stop: int, points: list[Point] = (),
           edits: dict[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] | None = None,
           kept: dict | None = None) -> tuple[torch.Tensor, dict[Point, torch.Tensor]]:
    """Run the residual stream `x` `[batch, pos, d_model]` entering block `start` through
    blocks `start` to `stop - 1`: the stream leaving the last one and the activation
    `[batch, pos, d_model]` at each point (`mlp_in` is what the MLP multiplies, after the
    norm's gain). `edits[layer](resid_mid, mlp_in)` returns the MLP input block `layer` uses
    instead; the stream that bypasses the MLP stays as it was. `kept[layer]` becomes each
    block's attention keys and values (`resume` reads them)."""
    check_architecture(model)
    eps, wanted, edits = model.cfg.eps, set(points), edits or {}
    found: dict[Point, torch.Tensor] = {}
    for layer in range(start, stop):
        block = model.blocks[layer]
        x = x + attention(model, layer, rms_norm(x, block.ln1.w, eps), kept)
        h = rms_norm(x, block.ln2.w, eps)
        if layer in edits:
            h = edits[layer](x, h)
        out = mlp(model, layer, h)
        for site, value in ((RESID_MID, x), (MLP_IN, h), (MLP_OUT, out)):
            if (layer, site) in wanted:
                found[layer, site] = value
        x = x + out
    return x, found


def resume(model: HookedTransformer, resid_mid: torch.Tensor, layer: int, stop: int, positions: torch.Tensor,
           kept: dict, edit: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A pass resumed at `positions [batch, pos]` of each row (-1: padding) from block `layer`'s
    resid_mid there `[batch, pos, d_model]`, through blocks `layer` to `stop - 1`: the stream
    leaving the last one and block `layer`'s MLP output, `[batch, pos, d_model]` each. `kept`:
    the attention keys and values of blocks after `layer` (`blocks(kept=...)`) of a pass of the
    same rows that differs from this one only at `positions` and later ones, so that the
    positions before them need not run again; `edit` changes block `layer`'s MLP input (as
    `blocks`' edits)."""
    check_architecture(model)
    eps, x = model.cfg.eps, resid_mid
    h = rms_norm(x, model.blocks[layer].ln2.w, eps)
    out = mlp(model, layer, h if edit is None else edit(x, h))
    x = x + out
    for later in range(layer + 1, stop):
        block = model.blocks[later]
        x = x + attention_at(model, later, rms_norm(x, block.ln1.w, eps), positions, *kept[later])
        x = x + mlp(model, later, rms_norm(x, block.ln2.w, eps))
    return x, out


class Streams:
    """The residual streams of fixed token batches, kept where the last pass of each left
    them, so that a stage reading one layer after another in increasing order runs each
    block once per batch: 4 block passes for the demo's 4 layers, where starting every
    layer from the embedding takes 10. A stream is kept per batch key (its first row, say)
    with the batch's tokens, and reused only for the same tokens. Kept streams live in host
    memory, one `[batch, pos, d_model]` per key, so that a GPU holds one batch as before;
    `clear` frees them. With `keep=False` nothing is kept: every pass starts from the
    embedding (a single layer's pass, which nothing would resume)."""

    def __init__(self, model: HookedTransformer, keep: bool = True):
        self.model, self.keep = model, keep
        self._kept: dict = {}  # key -> (tokens, layer, the stream entering that layer), on the CPU

    def clear(self) -> None:
        self._kept.clear()

    @torch.no_grad()
    def layer(self, key, tokens: torch.Tensor, layer: int, points: list[Point] = ()
              ) -> tuple[torch.Tensor, dict[Point, torch.Tensor]]:
        """Block `layer` of `tokens [batch, pos]`: the stream entering it and the value at
        each point (of this layer, `blocks`). Resumed from the stream kept under `key` when
        it was kept for the same tokens at or below `layer`, else run from the embedding;
        the stream leaving the block is kept in its place."""
        if any(at != layer for at, _ in points):
            raise ValueError(f"points {sorted(points)} are not all in layer {layer}")
        tokens = tokens.cpu()
        device = self.model.cfg.device
        kept = self._kept.get(key)
        if kept is not None and kept[1] <= layer and torch.equal(kept[0], tokens):
            start, x = kept[1], kept[2].to(device)
        else:
            start, x = 0, embed(self.model, tokens.to(device))
        x, _ = blocks(self.model, x, start, layer)
        after, found = blocks(self.model, x, layer, layer + 1, points)
        if self.keep:
            self._kept[key] = (tokens, layer + 1, after.cpu())
        return x, found


def unembed(model: HookedTransformer, x: torch.Tensor) -> torch.Tensor:
    """Logits `[..., d_vocab]` from the residual stream `x` `[..., d_model]` leaving the last block."""
    return F.linear(rms_norm(x, model.ln_final.w, model.cfg.eps), model.unembed.W_U.t(), model.unembed.b_U)


def run(model: HookedTransformer, tokens: torch.Tensor, points: list[Point] = ()
        ) -> tuple[torch.Tensor, dict[Point, torch.Tensor]]:
    """Run `tokens` `[batch, pos]` through the whole model: the logits `[batch, pos, d_vocab]`
    and the activation at each point."""
    x, found = blocks(model, embed(model, tokens), 0, model.cfg.n_layers, points)
    return unembed(model, x), found


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (nats) of each next token, `[batch, pos - 1]`, from logits `[batch, pos, d_vocab]`."""
    batch, pos, vocab = logits.shape
    # rows of logits, not the [batch, vocab, pos] view the loss takes for sequences: that layout's
    # float copy, log-softmax and their backward passes stride across the vocabulary
    flat = F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), tokens[:, 1:].reshape(-1), reduction="none")
    return flat.view(batch, pos - 1)
