"""Exact attribution graphs of one prompt through a bilinear transformer.

With the attention patterns `A[l] [heads, n, n]` and the RMS norms' per-token scales frozen at
their values on the prompt (as circuit-tracer freezes them), the residual stream is linear in
whatever writes into it, and each bilinear MLP is an exact quadratic form of its input:
`e_f . mlp(x) = x^T Q_f x + const`. Writing the MLP input as a sum of parts `x = sum_p x_p`,

    x^T Q_f x = sum_p x_p^T Q_f x          (edge p -> f, exact)
              = sum_{p,q} x_p^T Q_f x_q    (2 x_p^T Q_f x_q for p != q is the AND hyperedge (p, q) -> f)

Nodes (`kind`):
- `token`: the embedding of the prompt's token at a position (writes `W_E[token]`);
- `input`: an active latent of a layer's input SAE (on resid_mid, or on mlp_in) at a position;
  its value is its pre-activation, which is linear in the residual stream, so its incoming
  edges come from every residual writer upstream, through the residual and frozen attention;
  its only outgoing edges go into the same layer and position's MLP;
- `output`: an active latent of a layer's mlp_out SAE; its value is its pre-activation
  `e_f . (mlp_out - b_dec) + b_enc`, exactly `x^T Q_f x + c_f` of the MLP input; its incoming
  edges are the exact partition of that form over the MLP input's parts (the input latents,
  the input error, and the input SAE's `b_dec`, whose share is a constant); it writes
  `z_f d_f` into the residual stream;
- `input_error`: what the input SAE misses at a position (a part of the MLP input);
- `output_error`: what the output SAE misses at a position (written into the residual); a
  layer without SAEs has only this node, holding its whole MLP output;
- `logit`: a target token's logit at the last position minus the mean logit over the
  vocabulary (softmax ignores the mean; circuit-tracer demeans the same way).

Constants are no nodes: the biases of attention (`b_V W_O + b_O`, since pattern rows sum to
one), the output SAEs' `b_dec`, the input SAEs' `b_dec` share of the MLP's form, the encoders'
`b_enc - b_dec . e`, the MLP's `b_in W_out + b_out` and the unembedding bias enter each target's
`constant`. For every target, `sum of incoming edges + constant == value` exactly.

Features beyond `max_features` (smallest `|activation| * |decoder row|` first) are folded
into their position's error node, which keeps every identity exact while bounding memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from circuits.sae_basis import preactivation_offset
from circuits.sites import MLP_IN, MLP_OUT, RESID_MID
from circuits.bilinear import output_constant
from circuits.weights import MLPWeights, SAEWeights

KINDS = ("token", "input", "output", "input_error", "output_error", "logit")
TOKEN, INPUT, OUTPUT, INPUT_ERROR, OUTPUT_ERROR, LOGIT = range(len(KINDS))
ERRORS = (INPUT_ERROR, OUTPUT_ERROR)


@dataclass
class ModelTensors:
    """The weights of a bilinear TransformerLens model that attribution reads."""

    W_E: torch.Tensor  # [d_vocab, d]
    W_V: torch.Tensor  # [n_layers, heads, d, d_head]
    b_V: torch.Tensor  # [n_layers, heads, d_head]
    W_O: torch.Tensor  # [n_layers, heads, d_head, d]
    b_O: torch.Tensor  # [n_layers, d]
    g1: torch.Tensor  # [n_layers, d], gain of the attention's RMS norm
    mlps: list[MLPWeights]
    g_final: torch.Tensor  # [d]
    W_U: torch.Tensor  # [d, d_vocab]
    b_U: torch.Tensor  # [d_vocab]

    @property
    def n_layers(self) -> int:
        return self.W_V.shape[0]


@dataclass
class Frozen:
    """What one prompt fixes: its tokens, attention patterns and RMS scales (TransformerLens's
    `hook_scale`, `sqrt(mean(r^2) + eps)`, by which the norm divides)."""

    tokens: torch.Tensor  # [n] token ids
    pattern: torch.Tensor  # [n_layers, heads, n, n], rows (query positions) sum to one
    scale1: torch.Tensor  # [n_layers, n], before attention
    scale2: torch.Tensor  # [n_layers, n], before the MLP
    scale_final: torch.Tensor  # [n]

    def prefix(self, n: int) -> "Frozen":
        """The first `n` positions: exact for them, since attention is causal."""
        return Frozen(self.tokens[:n], self.pattern[:, :, :n, :n], self.scale1[:, :n], self.scale2[:, :n],
                      self.scale_final[:n])


def model_tensors(model, dtype: torch.dtype = torch.float64) -> ModelTensors:
    """The weights of a TransformerLens `HookedTransformer` with bilinear MLPs, in `dtype`."""
    from circuits.weights import from_hooked_transformer

    def cast(t):
        return t.detach().to(dtype)

    blocks = model.blocks
    ones = torch.ones(model.cfg.d_model, dtype=dtype)
    return ModelTensors(
        W_E=cast(model.W_E), W_V=cast(model.W_V), b_V=cast(model.b_V), W_O=cast(model.W_O), b_O=cast(model.b_O),
        g1=torch.stack([cast(b.ln1.w) if hasattr(b.ln1, "w") else ones for b in blocks]),
        mlps=[from_hooked_transformer(model, layer).to(dtype) for layer in range(model.cfg.n_layers)],
        g_final=cast(model.ln_final.w) if hasattr(model.ln_final, "w") else ones,
        W_U=cast(model.W_U), b_U=cast(model.b_U),
    )


def frozen_from_cache(tokens: torch.Tensor, cache, n_layers: int, dtype: torch.dtype = torch.float64) -> Frozen:
    """The frozen quantities of a TransformerLens cache of one prompt (batch 1)."""
    def get(name):
        return cache[name][0].detach().to(dtype)

    return Frozen(
        tokens=tokens.reshape(-1),
        pattern=torch.stack([get(f"blocks.{l}.attn.hook_pattern") for l in range(n_layers)]),
        scale1=torch.stack([get(f"blocks.{l}.ln1.hook_scale")[:, 0] for l in range(n_layers)]),
        scale2=torch.stack([get(f"blocks.{l}.ln2.hook_scale")[:, 0] for l in range(n_layers)]),
        scale_final=get("ln_final.hook_scale")[:, 0],
    )


def attention_constant(m: ModelTensors, layer: int) -> torch.Tensor:
    """What attention of `layer` adds at every position whatever its input: `sum_h b_V[h] W_O[h] + b_O`
    (pattern rows sum to one). `[d]`."""
    return torch.einsum("he,hed->d", m.b_V[layer], m.W_O[layer]) + m.b_O[layer]


def attention_linear(r: torch.Tensor, m: ModelTensors, f: Frozen, layer: int) -> torch.Tensor:
    """The frozen attention's linear part applied to residual parts `r [..., n, d]` -> `[..., n, d]`:
    `out_t = sum_h sum_s A[h,t,s] (g1 * r_s / scale1_s) W_V[h] W_O[h]`."""
    H, d, e = m.W_V[layer].shape
    x = r * (m.g1[layer] / f.scale1[layer].unsqueeze(-1))
    v = (x @ m.W_V[layer].permute(1, 0, 2).reshape(d, H * e)).unflatten(-1, (H, e)).transpose(-2, -3)
    z = f.pattern[layer] @ v  # [..., H, n, e]
    return z.transpose(-2, -3).flatten(-2) @ m.W_O[layer].reshape(H * e, d)


def attention_transpose(G: torch.Tensor, m: ModelTensors, f: Frozen, layer: int) -> torch.Tensor:
    """The adjoint of `attention_linear`: read vectors `G [..., n, d]` at resid_mid -> the read
    vectors they induce at resid_pre through attention, `[..., n, d]`. Plain matrix products
    (an einsum of these shapes runs several times slower)."""
    H, d, e = m.W_V[layer].shape
    u = (G @ m.W_O[layer].reshape(H * e, d).T).unflatten(-1, (H, e)).transpose(-2, -3)  # [..., H, n, e]
    w = f.pattern[layer].transpose(-1, -2) @ u  # [..., H, n(s), e]
    back = w.transpose(-2, -3).flatten(-2) @ m.W_V[layer].permute(1, 0, 2).reshape(d, H * e).T
    return back * (m.g1[layer] / f.scale1[layer].unsqueeze(-1))


def attention_transpose_at(read: torch.Tensor, pos: torch.Tensor, m: ModelTensors, f: Frozen,
                           layer: int) -> torch.Tensor:
    """`attention_transpose` of read vectors that sit at one position each: `read [T, d]` at
    positions `pos [T]` -> `[T, n, d]`. Through head h the read becomes one vector
    `y_h = W_V[h] W_O[h] read` spread over positions by the pattern's row, so this costs
    `T d^2 + T n heads d` instead of `2 T n d^2`."""
    H, d, e = m.W_V[layer].shape
    u = (read @ m.W_O[layer].reshape(H * e, d).T).unflatten(-1, (H, e))  # [T, H, e]
    y = torch.einsum("the,hde->thd", u, m.W_V[layer])  # [T, H, d]
    rows = f.pattern[layer][:, pos].transpose(0, 1)  # [T, H, n]: each target's query row
    return (rows.transpose(1, 2) @ y) * (m.g1[layer] / f.scale1[layer].unsqueeze(-1))


def mlp_input(r: torch.Tensor, m: ModelTensors, f: Frozen, layer: int) -> torch.Tensor:
    """The MLP input `g2 * r / scale2` of resid_mid `r [n, d]` (or parts `[..., n, d]`)."""
    return r * (m.mlps[layer].g / f.scale2[layer].unsqueeze(-1))


def mlp_forward(x: torch.Tensor, mlp: MLPWeights) -> torch.Tensor:
    """The bilinear MLP on its input `x [..., d]` -> `[..., d]`."""
    return ((x @ mlp.W_gate) * (x @ mlp.W_in) + mlp.b_in) @ mlp.W_out + mlp.b_out


def frozen_forward(m: ModelTensors, f: Frozen) -> dict[str, torch.Tensor]:
    """The model's forward pass with patterns and scales frozen: `resid_mid`, `mlp_in`, `mlp_out`
    `[n_layers, n, d]`, the final residual `[n, d]` and `logits [n, d_vocab]`. On the prompt the
    patterns came from it reproduces the real forward pass."""
    r = m.W_E[f.tokens]
    mids, ins, outs = [], [], []
    for layer in range(m.n_layers):
        r = r + attention_linear(r, m, f, layer) + attention_constant(m, layer)
        x = mlp_input(r, m, f, layer)
        out = mlp_forward(x, m.mlps[layer])
        mids.append(r)
        ins.append(x)
        outs.append(out)
        r = r + out
    logits = (r * (m.g_final / f.scale_final.unsqueeze(-1))) @ m.W_U + m.b_U
    return {RESID_MID: torch.stack(mids), MLP_IN: torch.stack(ins), MLP_OUT: torch.stack(outs),
            "resid_final": r, "logits": logits}


def read_back(G: torch.Tensor, m: ModelTensors, f: Frozen, layer: int, out_b_dec: list[torch.Tensor | None],
              positions: torch.Tensor | None = None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Carry read vectors back through the residual stream, MLPs cut (they are nodes).

    G `[T, n, d]`: each target's read vector at resid_mid of `layer` (`layer == n_layers`: the
    final residual). Yields `(slot, G_slot, constant)` for slot = layer, ..., 0, where `G_slot
    [T, n, d]` is the read at resid_pre of that slot (what the embeddings, slot 0, or the MLP of
    layer slot-1 write into) and `constant [T]` what the constants between this slot and the
    previous one contributed (attention biases, the output SAE's `b_dec` of layer slot-1, given
    per layer in `out_b_dec`, None where a layer has no output SAE). `positions [T]`: each
    target reads at this one position only (a cheaper first step).
    """
    for slot in range(layer, -1, -1):
        constant = G.new_zeros(G.shape[0])
        if slot < m.n_layers:
            constant += G.sum(1) @ attention_constant(m, slot)
            if slot == layer and positions is not None:
                G = G + attention_transpose_at(G[torch.arange(len(positions)), positions], positions, m, f, slot)
            else:
                G = G + attention_transpose(G, m, f, slot)
        if slot > 0 and out_b_dec[slot - 1] is not None:
            constant += G.sum(1) @ out_b_dec[slot - 1]
        yield slot, G, constant


def pair_terms(parts: torch.Tensor, mlp: MLPWeights, E: torch.Tensor) -> torch.Tensor:
    """`T[f, p, q] = x_p^T Q_f x_q` with `Q_f` the symmetrised interaction matrix of output
    direction `E[f]`: parts `[P, d]`, E `[F, d]` -> `[F, P, P]`, symmetric in (p, q).

    `x^T Q_f x = sum_{p,q} T[f,p,q]` for `x = sum_p parts[p]`; built from the factors
    (`Q_f = W_gate diag(W_out e_f) W_in^T`), never from a `[d, d]` matrix per output.
    """
    a, c = parts @ mlp.W_gate, parts @ mlp.W_in  # [P, h]
    w = E @ mlp.W_out.T  # [F, h]
    T = (w.unsqueeze(1) * a.unsqueeze(0)) @ c.T  # [F, P, P]
    return 0.5 * (T + T.transpose(1, 2))


def _active(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, latents) of the nonzero entries of `z [n, d_sae]`, by position then latent."""
    pos, idx = torch.nonzero(z, as_tuple=True)
    return pos, idx


@dataclass
class LayerSAETensors:
    """One layer's SAEs for attribution: the input SAE and the site it reads, and the mlp_out SAE."""

    sae_in: SAEWeights
    site: str  # resid_mid or mlp_in
    sae_out: SAEWeights


@dataclass
class AttributionGraph:
    """A prompt's full graph: node arrays `[N]` and the dense adjacency `[N, N]` (rows targets,
    columns sources), with the AND hyperedges as arrays `[H]`."""

    kind: torch.Tensor  # [N] index into KINDS
    layer: torch.Tensor  # [N] model layer (-1 for tokens, n_layers for logits)
    pos: torch.Tensor  # [N]
    index: torch.Tensor  # [N] latent index, token id (tokens and logits), -1 for errors
    value: torch.Tensor  # [N] pre-activation (features), demeaned logit, the norm of an error's vector
    constant: torch.Tensor  # [N] the target's constant term (0 for sources)
    adjacency: torch.Tensor  # [N, N] direct effect of column on row
    probability: torch.Tensor  # [N] softmax probability of a logit node's token (0 elsewhere)
    and_target: torch.Tensor  # [H] node ids
    and_a: torch.Tensor  # [H]
    and_b: torch.Tensor  # [H]
    and_weight: torch.Tensor  # [H] 2 x_a^T Q x_b

    @property
    def targets(self) -> torch.Tensor:
        """Mask `[N]` of nodes with incoming edges (features and logits)."""
        return (self.kind == INPUT) | (self.kind == OUTPUT) | (self.kind == LOGIT)


def attribute(m: ModelTensors, f: Frozen, saes: dict[int, LayerSAETensors], target_tokens: torch.Tensor,
              max_features: int | None = None, n_and: int = 3, chunk: int = 256,
              edge_dtype: torch.dtype = torch.float32, progress=None) -> AttributionGraph:
    """The attribution graph of one prompt (see the module docstring).

    `saes` maps layers to their SAEs (layers without are one `output_error` per position);
    `target_tokens [k]` are the logits attributed, at the last position. `n_and` AND
    hyperedges are kept per output feature (largest |weight|, feature and error parts only).
    `chunk` targets are carried back at once. Memory: the adjacency, `N^2` numbers of
    `edge_dtype` with N at most `max_features` plus `2 n n_layers + n + k`, and `chunk * n * d`
    numbers per read-back.
    """
    dtype = m.W_E.dtype
    n, L = f.tokens.shape[0], m.n_layers
    fwd = frozen_forward(m, f)
    # ---- activations and kept features per layer
    z_in, z_out = {}, {}
    for layer, s in saes.items():
        z_in[layer] = s.sae_in.encode(fwd[s.site][layer])
        z_out[layer] = s.sae_out.encode(fwd[MLP_OUT][layer])
    keep_in, keep_out = _cap(z_in, z_out, saes, max_features)

    # ---- nodes: tokens, then per layer inputs, input errors, outputs, output errors, then logits
    rows: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # kind, layer, pos, index, value
    ar = torch.arange(n)
    rows.append((TOKEN, -1, ar, f.tokens, torch.zeros(n, dtype=dtype)))
    where: dict[tuple[int, int], int] = {}  # (kind, layer) -> first node id
    parts_in, writes = {}, {}
    count = n
    for layer in range(L):
        s = saes.get(layer)
        if s is not None:
            zi = z_in[layer] * keep_in[layer]
            pos, idx = _active(zi)
            where[(INPUT, layer)] = count
            rows.append((INPUT, layer, pos, idx, z_in[layer][pos, idx]))
            count += len(pos)
            recon = zi @ s.sae_in.W_dec  # without b_dec
            err = fwd[s.site][layer] - recon - s.sae_in.b_dec
            parts_in[layer] = (pos, idx, zi, err)
            where[(INPUT_ERROR, layer)] = count
            rows.append((INPUT_ERROR, layer, ar, torch.full((n,), -1), err.norm(dim=-1)))
            count += n
            zo = z_out[layer] * keep_out[layer]
            pos_o, idx_o = _active(zo)
            where[(OUTPUT, layer)] = count
            rows.append((OUTPUT, layer, pos_o, idx_o, z_out[layer][pos_o, idx_o]))
            count += len(pos_o)
            err_o = fwd[MLP_OUT][layer] - zo @ s.sae_out.W_dec - s.sae_out.b_dec
            writes[layer] = (pos_o, zo[pos_o, idx_o].unsqueeze(1) * s.sae_out.W_dec[idx_o], err_o)
        else:
            writes[layer] = (ar[:0], fwd[MLP_OUT][layer][:0], fwd[MLP_OUT][layer])
            err_o = fwd[MLP_OUT][layer]
        where[(OUTPUT_ERROR, layer)] = count
        rows.append((OUTPUT_ERROR, layer, ar, torch.full((n,), -1), err_o.norm(dim=-1)))
        count += n
    logits = fwd["logits"][-1]
    demeaned = logits - logits.mean()
    k = target_tokens.shape[0]
    where[(LOGIT, L)] = count
    rows.append((LOGIT, L, torch.full((k,), n - 1), target_tokens, demeaned[target_tokens]))
    count += k
    N = count
    kind = torch.cat([torch.full((len(r[2]),), r[0]) for r in rows])
    graph = AttributionGraph(
        kind=kind, layer=torch.cat([torch.full((len(r[2]),), r[1]) for r in rows]),
        pos=torch.cat([r[2] for r in rows]), index=torch.cat([r[3] for r in rows]),
        value=torch.cat([r[4] for r in rows]), constant=torch.zeros(N, dtype=dtype),
        adjacency=torch.zeros(N, N, dtype=edge_dtype), probability=torch.zeros(N, dtype=dtype),
        and_target=torch.zeros(0, dtype=torch.long), and_a=torch.zeros(0, dtype=torch.long),
        and_b=torch.zeros(0, dtype=torch.long), and_weight=torch.zeros(0, dtype=dtype))
    graph.probability[where[(LOGIT, L)]:] = torch.softmax(logits, -1)[target_tokens]

    # ---- residual writers by slot: (node ids [W], positions [W], vectors [W, d])
    writers = {0: _by_position(ar, ar, m.W_E[f.tokens], n)}
    for layer in range(L):
        pos_o, vec_o, err_o = writes[layer]
        first = where.get((OUTPUT, layer), 0)
        ids = torch.cat([first + torch.arange(len(pos_o)), where[(OUTPUT_ERROR, layer)] + ar])
        writers[layer + 1] = _by_position(ids, torch.cat([pos_o, ar]), torch.cat([vec_o, err_o]), n)
    out_b_dec = [saes[layer].sae_out.b_dec if layer in saes else None for layer in range(L)]

    def linear_targets(ids: torch.Tensor, G: torch.Tensor, layer: int, base: torch.Tensor,
                       positions: torch.Tensor | None) -> None:
        """Targets `ids` reading `G [T, n', d]` at resid_mid of `layer`, at positions below n'
        (later positions cannot reach them); `positions`: each reads at this one only."""
        constant = base.clone()
        short = G.shape[1]
        for slot, G_slot, c in read_back(G, m, f.prefix(short), layer, out_b_dec, positions):
            constant += c
            src, spos, column, padded = writers[slot]
            here = spos < short
            edges = torch.bmm(G_slot.transpose(0, 1), padded[:short])  # [n', T, most writers at a position]
            graph.adjacency[ids.unsqueeze(1), src[here].unsqueeze(0)] = edges[spos[here], :, column[here]].T.to(edge_dtype)
        graph.constant[ids] = constant

    # ---- input features: linear in the residual stream at resid_mid
    for layer, s in saes.items():
        first = where[(INPUT, layer)]
        pos, idx = parts_in[layer][0], parts_in[layer][1]
        for start in range(0, len(pos), chunk):
            p, i = pos[start:start + chunk], idx[start:start + chunk]
            read = s.sae_in.W_enc[:, i].T  # [T, d] at the SAE's site
            if s.site == MLP_IN:  # the SAE reads g2 * r / scale2
                read = read * (m.mlps[layer].g / f.scale2[layer][p].unsqueeze(1))
            G = torch.zeros(len(p), int(p.max()) + 1, read.shape[1], dtype=dtype)  # inputs are ordered by position
            G[torch.arange(len(p)), p] = read
            shift = s.sae_in.b_dec if s.sae_in.apply_b_dec_to_input else torch.zeros_like(s.sae_in.b_dec)
            base = s.sae_in.b_enc[i] - shift @ s.sae_in.W_enc[:, i]
            linear_targets(first + start + torch.arange(len(p)), G, layer, base, p)
            if progress is not None:
                progress(len(p))
    # ---- logits: linear in the final residual
    read = (m.W_U[:, target_tokens] - m.W_U.mean(1, keepdim=True)).T * (m.g_final / f.scale_final[-1])
    G = torch.zeros(k, n, read.shape[1], dtype=dtype)
    G[:, n - 1] = read
    linear_targets(where[(LOGIT, L)] + torch.arange(k), G, L, m.b_U[target_tokens] - m.b_U.mean(), None)

    # ---- output features: the exact partition of the MLP's quadratic form
    ands = []
    for layer, s in saes.items():
        pos, idx, zi, err = parts_in[layer]
        pos_o, _, _ = writes[layer]
        idx_o = graph.index[where[(OUTPUT, layer)]:where[(OUTPUT, layer)] + len(pos_o)]
        mlp = s.sae_out
        offset = preactivation_offset(mlp.W_enc, mlp.b_enc, mlp.b_dec, mlp.apply_b_dec_to_input,
                                      output_constant(m.mlps[layer].W_out, m.mlps[layer].b_in, m.mlps[layer].b_out))
        for t in pos_o.unique().tolist():
            here = (pos == t).nonzero().squeeze(1)
            src = torch.cat([where[(INPUT, layer)] + here, torch.tensor([where[(INPUT_ERROR, layer)] + t])])
            vec = torch.cat([zi[t, idx[here]].unsqueeze(1) * s.sae_in.W_dec[idx[here]], err[t:t + 1],
                             s.sae_in.b_dec.unsqueeze(0)])
            parts = vec if s.site == MLP_IN else vec * (m.mlps[layer].g / f.scale2[layer][t])
            outs = (pos_o == t).nonzero().squeeze(1)
            tgt = where[(OUTPUT, layer)] + outs
            T = pair_terms(parts, m.mlps[layer], mlp.W_enc[:, idx_o[outs]].T)
            edges = T.sum(2)  # [F, P]
            graph.adjacency[tgt.unsqueeze(1), src.unsqueeze(0)] = edges[:, :-1].to(edge_dtype)
            graph.constant[tgt] = offset[idx_o[outs]] + edges[:, -1]
            if n_and > 0 and len(src) > 1:
                pair = 2 * T[:, :-1, :-1].triu(1)  # the constant part is not a source
                flat = pair.reshape(len(tgt), -1)
                top = flat.abs().topk(min(n_and, flat.shape[1]), dim=1)
                a, b = top.indices // pair.shape[1], top.indices % pair.shape[1]
                w = flat.gather(1, top.indices)
                nz = w != 0
                ands.append((tgt.unsqueeze(1).expand_as(a)[nz], src[a[nz]], src[b[nz]], w[nz]))
    if ands:
        graph.and_target, graph.and_a, graph.and_b, graph.and_weight = (torch.cat(c) for c in zip(*ands))
    return graph


def _by_position(ids: torch.Tensor, pos: torch.Tensor, vectors: torch.Tensor, n: int):
    """Writers grouped by position for one batched product: (ids `[W]`, positions `[W]`, column
    of each within its position `[W]`, vectors padded with zeros `[n, d, most at a position]`)."""
    order = torch.argsort(pos, stable=True)
    ids, pos, vectors = ids[order], pos[order], vectors[order]
    counts = torch.bincount(pos, minlength=n)
    starts = torch.cumsum(counts, 0) - counts
    column = torch.arange(len(pos)) - starts[pos]
    padded = vectors.new_zeros(n, vectors.shape[1], int(counts.max()) if len(pos) else 0)
    padded[pos, :, column] = vectors
    return ids, pos, column, padded


def _cap(z_in: dict, z_out: dict, saes: dict[int, LayerSAETensors], max_features: int | None):
    """Masks of the features kept as nodes: all, or the `max_features` with the largest
    `|activation| * |decoder row|` (what each writes); the rest join their error node."""
    keep_in = {layer: z != 0 for layer, z in z_in.items()}
    keep_out = {layer: z != 0 for layer, z in z_out.items()}
    total = sum(int(v.sum()) for v in keep_in.values()) + sum(int(v.sum()) for v in keep_out.values())
    if max_features is None or total <= max_features:
        return keep_in, keep_out
    sizes = []
    for layer, s in saes.items():
        sizes.append((z_in[layer].abs() * s.sae_in.W_dec.norm(dim=1)).flatten())
        sizes.append((z_out[layer].abs() * s.sae_out.W_dec.norm(dim=1)).flatten())
    cut = torch.cat(sizes).topk(max_features).values[-1]
    for layer, s in saes.items():
        keep_in[layer] &= z_in[layer].abs() * s.sae_in.W_dec.norm(dim=1) >= cut
        keep_out[layer] &= z_out[layer].abs() * s.sae_out.W_dec.norm(dim=1) >= cut
    return keep_in, keep_out


# ------------------------------------------------------------------ influence, pruning, scores
# Definitions as circuit-tracer's (graph.py): edges are normalised by each target's total
# |incoming| weight; a node's influence is its total weight over all paths into the logits,
# each logit weighted by its probability.


def normalised(adjacency: torch.Tensor) -> torch.Tensor:
    """`|A|` with each row divided by its sum (rows of zeros stay zero). `[N, N] -> [N, N]`."""
    a = adjacency.abs()
    return a / a.sum(1, keepdim=True).clamp_min(1e-10)


def influence(adjacency: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`w A + w A^2 + ...` with `A = normalised(adjacency)`, `weights [N]` (the logits'
    probabilities): each node's influence on the logits over paths of every length. The graph
    is acyclic, so the series ends after its depth. `[N]`."""
    A = normalised(adjacency)
    step = weights @ A
    total = step.clone()
    for _ in range(A.shape[0]):
        if not step.any():
            return total
        step = step @ A
        total += step
    raise ValueError("the adjacency has a cycle: influence does not converge")


def _threshold(scores: torch.Tensor, share: float) -> torch.Tensor:
    """The score at which the largest scores reach `share` of their total (zeros, most of a
    graph's possible edges, change no cumulative share, so only nonzero scores are sorted)."""
    nonzero = scores[scores != 0]
    if not len(nonzero):
        return scores.new_zeros(())
    ordered = nonzero.sort(descending=True).values
    cumulative = ordered.cumsum(0) / ordered.sum().clamp_min(1e-30)
    return ordered[min(int(torch.searchsorted(cumulative, share)), len(ordered) - 1)]


def prune(graph: AttributionGraph, node_threshold: float = 0.8, edge_threshold: float = 0.98,
          node_inf: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Circuit-tracer's pruning: keep the nodes of largest influence up to `node_threshold` of
    the total (tokens and logits always), then the edges of largest influence (normalised
    weight times the influence of its target, plus the target's logit weight) up to
    `edge_threshold`; then drop, repeatedly, features and errors left without an outgoing kept
    edge and features without an incoming one. `node_inf`: `node_influence(graph)` if already
    known. Returns (node mask `[N]`, edge mask `[N, N]`, cumulative influence share `[N]`: the
    share of all influence held by nodes at least as influential)."""
    A = graph.adjacency
    weights = graph.probability.to(A.dtype)
    node_inf = node_influence(graph) if node_inf is None else node_inf
    always = (graph.kind == TOKEN) | (graph.kind == LOGIT)
    keep = torch.nonzero((node_inf >= _threshold(node_inf, node_threshold)) | always).squeeze(1)
    # the edges among kept nodes only: the same scores as on the full matrix with the rest zeroed
    kept = A[keep][:, keep]
    w = weights[keep]
    edge_inf = normalised(kept) * (influence(kept, w) + w).unsqueeze(1)
    edges = (edge_inf >= _threshold(edge_inf.flatten(), edge_threshold)) & (kept != 0)
    features = ((graph.kind == INPUT) | (graph.kind == OUTPUT))[keep]
    middle = ~always[keep]
    nodes = torch.ones(len(keep), dtype=torch.bool)
    while True:
        before = nodes.clone()
        edges &= nodes.unsqueeze(1) & nodes.unsqueeze(0)
        nodes &= ~middle | edges.any(0)
        nodes &= ~features | edges.any(1)
        if torch.equal(before, nodes):
            break
    node_mask = torch.zeros(A.shape[0], dtype=torch.bool)
    node_mask[keep] = nodes
    edge_mask = torch.zeros(A.shape, dtype=torch.bool)
    rows, cols = torch.nonzero(edges, as_tuple=True)
    edge_mask[keep[rows], keep[cols]] = True
    order = node_inf.sort(descending=True)
    cumulative = torch.zeros_like(node_inf)
    cumulative[order.indices] = order.values.cumsum(0) / order.values.sum().clamp_min(1e-30)
    return node_mask, edge_mask, cumulative


def node_influence(graph: AttributionGraph) -> torch.Tensor:
    """Each node's influence on the logits, weighted by their probabilities. `[N]`."""
    return influence(graph.adjacency, graph.probability.to(graph.adjacency.dtype))


def scores(graph: AttributionGraph, node_inf: torch.Tensor | None = None) -> tuple[float, float]:
    """(replacement, completeness), as circuit-tracer defines them on the unpruned graph.

    Replacement: of the influence that tokens and error nodes have on the logits, the share of
    the tokens'. Completeness: the mean over nodes, weighted by their influence plus their logit
    weight, of the share of each node's normalised incoming weight that comes from non-error nodes.
    """
    A = graph.adjacency
    weights = graph.probability.to(A.dtype)
    node_inf = node_influence(graph) if node_inf is None else node_inf
    error = (graph.kind == INPUT_ERROR) | (graph.kind == OUTPUT_ERROR)
    tokens = node_inf[graph.kind == TOKEN].sum()
    replacement = tokens / (tokens + node_inf[error].sum())
    non_error = 1 - normalised(A)[:, error].sum(1)
    weight = node_inf + weights
    completeness = (non_error * weight).sum() / weight.sum()
    return float(replacement), float(completeness)


def strongest_path(graph: AttributionGraph, sources: list[int], target: int) -> tuple[list[int], float]:
    """The path from any of the nodes `sources` to node `target` whose product of normalised
    edge weights is largest (max-product over the acyclic graph): its node ids and that
    product; `([], 0.0)` if no path exists."""
    A = normalised(graph.adjacency)
    best = torch.zeros(A.shape[0], dtype=A.dtype)
    best[sources] = 1.0
    parent = torch.full((A.shape[0],), -1, dtype=torch.long)
    for _ in range(A.shape[0]):  # relax to a fixed point: at most the graph's depth rounds
        value, arg = (A * best.unsqueeze(0)).max(1)
        better = value > best
        if not better.any():
            break
        best = torch.where(better, value, best)
        parent = torch.where(better, arg, parent)
    if best[target] == 0:
        return [], 0.0
    path = [target]
    while parent[path[-1]] >= 0:
        path.append(int(parent[path[-1]]))
    return path[::-1], float(best[target])
