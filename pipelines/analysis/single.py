"""A few output features of a layer, analysed alone: the circuit tables of
`pipelines.analysis.circuit_tables` restricted to them, and the token rows they are measured on
when a caller brings token ids or texts instead of a run's token store.

Only the chosen features' interaction matrices are built, projected and diagonalised; the
token pass encodes the output SAE whole (its TopK compares every latent) and keeps the chosen
columns. Every per-feature number equals the whole layer's, except two that depend on the
other features: `layer_rank` of `gates` ranks among the chosen features only, and the
tokens sampled into `lowrank_samples` are another seeded draw.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import numpy as np
import pandas as pd
import torch

from circuits.layer import CircuitConfig, LayerBatch, Outputs, select_outputs
from circuits.sites import DEFAULT_INPUT_SITE
from circuits.weights import MLPWeights, SAEWeights
from pipelines.analysis.circuit_tables import analyse_layer
from pipelines.data.tokens import TokenRows


def analyse_outputs(mlp: MLPWeights, sae_in: SAEWeights, outputs: Outputs, features: Sequence[int],
                    batches: Callable[[], Iterable[LayerBatch]] | None, cfg: CircuitConfig, *, layer: int,
                    input_site: str = DEFAULT_INPUT_SITE) -> dict[str, pd.DataFrame]:
    """The circuit tables of the output features `features` of `outputs` alone (see the
    module docstring), numbered as in the whole set. `batches` gives the layer's
    `LayerBatch`es with the activations of every output (as for `analyse_layer`)."""
    n_out = outputs.directions.shape[0]
    chosen = [int(f) for f in features]
    bad = [f for f in chosen if not 0 <= f < n_out]
    if bad or not chosen or len(set(chosen)) != len(chosen):
        raise ValueError(f"features must be distinct output features in [0, {n_out}), got {list(features)}")
    index = torch.tensor(chosen, dtype=torch.long)
    subset = select_outputs(outputs, index.to(outputs.directions.device))
    sliced = None
    if batches is not None and outputs.sae is not None:
        sliced = lambda: (replace(b, acts=b.acts[:, index.to(b.acts.device)]) for b in batches())  # noqa: E731
    tables = analyse_layer(mlp, sae_in, subset, sliced, cfg, layer=layer, input_site=input_site)
    numbers = np.asarray(chosen, dtype=np.int64)
    return {name: frame.assign(out_feature=numbers[frame["out_feature"].to_numpy(dtype=np.int64)])
            if "out_feature" in frame.columns else frame for name, frame in tables.items()}


def token_rows(rows: Sequence[Sequence[int]] | torch.Tensor | np.ndarray, n_ctx: int, bos_id: int | None,
               truncate: bool = False, name: str = "tokens") -> list[TokenRows]:
    """Token rows to analyse from token ids: a `[n, length]` array as it is, or rows of any
    lengths, each cut to `n_ctx` when `truncate` (else a row longer than `n_ctx` is an error
    naming `name`). Rows of different lengths are padded on the right with `bos_id`, which
    the analysis skips (a causal model's earlier positions do not see it); without a BOS
    they are grouped by length instead. Every row's first position is skipped, as in a run."""
    if isinstance(rows, (torch.Tensor, np.ndarray)) and np.asarray(rows).ndim == 2:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.shape[1] > n_ctx and not truncate:
            raise ValueError(f"{name} has rows of {rows.shape[1]} tokens, more than the model's context of {n_ctx}: "
                             "pass truncate=True or shorten them")
        return [_rows(rows[:, :n_ctx], bos_id)] if rows.size else []
    found = []
    for i, row in enumerate(rows):
        ids = [int(t) for t in (row.tolist() if isinstance(row, (torch.Tensor, np.ndarray)) else row)]
        if len(ids) > n_ctx:
            if not truncate:
                raise ValueError(f"{name}[{i}] has {len(ids)} tokens, more than the model's context of {n_ctx}: pass "
                                 "truncate=True or shorten it")
            ids = ids[:n_ctx]
        if len(ids) > 1:  # a row's first position is never analysed
            found.append(ids)
    if not found:
        raise ValueError(f"{name} holds no row of two tokens or more: nothing to analyse")
    if bos_id is not None:
        width = max(len(ids) for ids in found)
        return [_rows(np.array([ids + [bos_id] * (width - len(ids)) for ids in found], dtype=np.int64), bos_id)]
    lengths = sorted({len(ids) for ids in found})
    return [_rows(np.array([ids for ids in found if len(ids) == n], dtype=np.int64), None) for n in lengths]


def _rows(tokens: np.ndarray, bos_id: int | None) -> TokenRows:
    """Rows taken as documents of their own (a BOS inside a row starts another): what a
    description's one context per document counts by."""
    return TokenRows(tokens, np.arange(len(tokens), dtype=np.int64) * tokens.shape[1], {}, bos_id)


def judge_tables(model, saes, rows: TokenRows, circuits: dict[str, pd.DataFrame], features: pd.DataFrame | None,
                 labels: pd.DataFrame | None, tokenizer, untrained: np.ndarray, rules, streams=None
                 ) -> dict[str, pd.DataFrame]:
    """The verdicts stage's tables (`pair_gates`, `group_gates`, `gate_verdicts`, ...) of the
    output features in `circuits` (a layer's circuit tables, or one feature's), judged on
    `rows` with what the `features` and `feature_labels` tables of the layer say (None: nothing
    known; no labels, no tags). `tokenizer` (a `tokenizers.Tokenizer`, or None) lists what each
    output boosts, `untrained` the token ids never to list; `rules` is a `VerdictConfig`."""
    from pipelines import schemas
    from pipelines.analysis.features import boosted_token_ids
    from pipelines.analysis.judge import CIRCUIT_READS, judge_layer
    from pipelines.analysis.verdicts import InputFacts
    from pipelines.data.tags import tags_of

    layer = saes.layer
    boosted = {} if tokenizer is None else boosted_token_ids(model, saes.sae_out.weights.W_dec, tokenizer, untrained)
    facts = InputFacts.of(features, labels, layer, saes.input_site, rules)
    return judge_layer(model, saes, rows, {name: circuits[name] for name in CIRCUIT_READS}, facts=facts,
                       tags=tags_of(labels, schemas.GATE_TAGS), boosted=boosted, cfg=rules, streams=streams)
