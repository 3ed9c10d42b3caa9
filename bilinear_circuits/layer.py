"""One layer of a bilinear `HookedTransformer` with its two SAEs, in memory: no run folder."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from bilinear_circuits.feature import Feature, with_descriptions
from circuits.layer import CircuitConfig, Outputs
from circuits.sae_basis import output_directions
from circuits.sites import INPUT_SITES, OUTPUT_SITE, site_of_hook
from circuits.weights import SAEWeights, from_hooked_transformer, from_sae_lens

if TYPE_CHECKING:  # annotations only: importing them takes seconds
    import torch
    from sae_lens import SAE
    from transformer_lens import HookedTransformer

IN_MEMORY = Path("<in memory>")  # where an SAE passed as an object "lives" in error messages


class Layer:
    """Layer `layer` of a bilinear `HookedTransformer` with its input SAE (on `resid_mid`, or
    `mlp_in`) and its output SAE (on `mlp_out`), and the tokens its statistics are measured on.

    Args:
        model: the bilinear LM (`gated_mlp=True`, identity activation, RMS norm).
        sae_in: the input SAE: an sae-lens `SAE` (TopK or ReLU) or `circuits.SAEWeights`.
        sae_out: the output SAE, likewise.
        layer: the block; by default the layer the SAEs' hook names record.
        tokens: token ids: a `[n, length]` tensor or array, or rows of any lengths. Rows are
            used as they are (BOS and every row's first position are skipped, as in a run).
        texts: texts instead of `tokens`: each is tokenized (BOS first), and padded into batches.
        tokenizer: what tokenizes `texts`: a `tokenizers.Tokenizer` or a Hugging Face tokenizer
            (default: `model.tokenizer`).
        truncate: cut rows and texts longer than the model's context instead of refusing them.
        config: the analysis settings (`CircuitConfig`).
        input_site: where `sae_in` reads; by default what its hook name records (needed for an
            SAE that records none, or an `SAEWeights`).
        batch_rows: rows per forward pass.
        descriptions: a `features` table to join descriptions from (a run's).
        labels: a `feature_labels` table (a run's): what the verdicts read of each feature's
            label classes, and the gate tags they write.

    Every feature's interactions and spectrum are read from the weights; low-rank
    correlations, gate statistics and scatter samples need tokens (without any, those tables
    are absent). Results are those of the `circuits` stage on the same model, SAEs and tokens.
    """

    def __init__(self, model: HookedTransformer, sae_in: SAE | SAEWeights, sae_out: SAE | SAEWeights,
                 layer: int | None = None, *, tokens: torch.Tensor | np.ndarray | Sequence[Sequence[int]] | None = None,
                 texts: Sequence[str] | None = None, tokenizer: object | None = None, truncate: bool = False,
                 config: CircuitConfig | None = None, input_site: str | None = None, batch_rows: int = 32,
                 descriptions: pd.DataFrame | None = None, labels: pd.DataFrame | None = None):
        from pipelines.inputs import LayerSAEs

        self.model = model
        self.config = config or CircuitConfig()
        in_weights, in_point = _sae(sae_in, "sae_in")
        out_weights, out_point = _sae(sae_out, "sae_out")
        recorded = {p[0] for p in (in_point, out_point) if p is not None}
        if layer is None:
            if len(recorded) != 1:
                raise ValueError("layer: the SAEs record no single layer in their hook names, so pass layer=")
            layer = recorded.pop()
        self.layer = int(layer)
        if not 0 <= self.layer < model.cfg.n_layers:
            raise ValueError(f"layer {layer} does not exist: the model has {model.cfg.n_layers}")
        for name, point, sites in (("sae_in", in_point, INPUT_SITES), ("sae_out", out_point, (OUTPUT_SITE,))):
            if point is not None and (point[0] != self.layer or point[1] not in sites):
                raise ValueError(f"{name} reads layer {point[0]}'s {point[1]}, not layer {self.layer}'s "
                                 f"{' or '.join(sites)}")
        site = input_site or (in_point[1] if in_point is not None else None)
        if site not in INPUT_SITES:
            raise ValueError(f"input_site must be one of {', '.join(INPUT_SITES)} (sae_in records no hook that says "
                             f"where it reads), got {site!r}")
        self.input_site = site
        for name, w in (("sae_in", in_weights), ("sae_out", out_weights)):
            if w.d_in != model.cfg.d_model:
                raise ValueError(f"{name} reads width {w.d_in} but the model's d_model is {model.cfg.d_model}")
        device = model.cfg.device
        self._saes = LayerSAEs(self.layer, _loaded(in_weights.to(in_weights.W_enc.dtype, device), (layer, site)),
                               site, _loaded(out_weights.to(out_weights.W_enc.dtype, device), (layer, OUTPUT_SITE)))
        self.descriptions = descriptions
        self.labels = labels
        self.batch_rows = batch_rows
        self._tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        self._rows = self._token_rows(tokens, texts, truncate)
        self._verdict_rows = None  # a run's held-out rows, which its verdicts stage reads (`Run.layer`)
        self._untrained = np.zeros(0, dtype=np.int64)  # token ids never listed as boosted
        self._tables: dict[str, pd.DataFrame] | None = None

    def __repr__(self) -> str:
        n = sum(len(r) for r in self._rows)
        return f"Layer(layer={self.layer}, input_site={self.input_site!r}, rows={n})"

    @property
    def sae_in(self) -> SAEWeights:
        """The input SAE's weights (`circuits.SAEWeights`)."""
        return self._saes.sae_in.weights

    @property
    def sae_out(self) -> SAEWeights:
        """The output SAE's weights (`circuits.SAEWeights`)."""
        return self._saes.sae_out.weights

    def _token_rows(self, tokens, texts, truncate: bool):
        from pipelines.analysis.single import token_rows

        if tokens is not None and texts is not None:
            raise ValueError("pass tokens or texts, not both")
        n_ctx = self.model.cfg.n_ctx
        if texts is not None:
            if isinstance(texts, str):
                raise ValueError("texts must be a list of strings, not one string")
            if self._tokenizer is None:
                raise ValueError("tokenizer: the model has none, so pass the tokenizer of texts")
            ids, bos = encode_texts(texts, self._tokenizer)
            return token_rows(ids, n_ctx, bos, truncate, name="texts")
        if tokens is None:
            return []
        bos = bos_id(self._tokenizer)
        return token_rows(tokens, n_ctx, bos, truncate, name="tokens")

    def batches(self):
        """A callable giving a fresh pass of `circuits.LayerBatch`es over the tokens, or None
        without tokens."""
        from pipelines.inputs import layer_batches

        if not self._rows:
            return None
        passes = [layer_batches(self.model, rows, len(rows), self._saes, self.batch_rows) for rows in self._rows]
        return lambda: itertools.chain.from_iterable(p() for p in passes)

    def _outputs(self) -> Outputs:
        w = self.sae_out
        return Outputs("sae", output_directions(w.W_enc, w.W_dec, "encoder"), sae=w)

    def feature(self, feature: int, verdicts: bool = False, rules=None) -> Feature:
        """Output feature `feature`, analysed alone: its interaction matrix built, projected into
        the input SAE's basis and diagonalised, and its statistics measured on the tokens. With
        `verdicts`, its candidate pairs and group gates are also tested by intervention, typed,
        ablated and judged as the verdicts stage does (`VerdictConfig` in `rules`), for this
        feature alone (needs tokens)."""
        from pipelines.analysis.single import analyse_outputs

        if not 0 <= int(feature) < self.sae_out.d_sae:
            raise ValueError(f"feature must be an output feature in [0, {self.sae_out.d_sae}), got {feature}")
        tables = analyse_outputs(from_hooked_transformer(self.model, self.layer), self.sae_in, self._outputs(),
                                 [feature], self.batches(), self.config, layer=self.layer, input_site=self.input_site)
        if verdicts:
            tables.update(self._judge(tables, rules))
        return Feature(self.layer, int(feature), self.input_site, tables, self.descriptions, self._submatrix(feature))

    def _judge(self, tables: dict[str, pd.DataFrame], rules) -> dict[str, pd.DataFrame]:
        from pipelines.analysis.single import judge_tables
        from pipelines.analysis.verdicts import VerdictConfig

        rows = self._verdict_rows if self._verdict_rows is not None else self._one_group("verdicts")
        return judge_tables(self.model, self._saes, rows, tables, self.descriptions, self.labels,
                            self._listing_tokenizer(), self._untrained, rules or VerdictConfig())

    def describe(self, config=None) -> pd.DataFrame:
        """Describe every feature of both SAEs on the tokens as the features stage does
        (`FeatureConfig` in `config`): top contexts, boosted tokens, a one-line description.
        Each row of tokens counts as a document of its own (a BOS in it starts another) where the
        contexts are drawn one per document. The `features` table is kept as `descriptions`
        (joined from then on) and returned."""
        from pipelines.analysis.features import FeatureConfig, feature_tables

        tokenizer = self._listing_tokenizer()
        if tokenizer is None:
            raise ValueError("tokenizer: descriptions need a tokenizers.Tokenizer or a Hugging Face fast tokenizer")
        saes = {(self.layer, self.input_site): self.sae_in, (self.layer, OUTPUT_SITE): self.sae_out}
        self.descriptions, self.labels = feature_tables(self.model, tokenizer, self._one_group("descriptions"), saes,
                                                        config or FeatureConfig(), {}, {}, None)
        return self.descriptions

    def _one_group(self, what: str):
        if len(self._rows) != 1:
            raise ValueError(f"{what} need tokens: a [n, length] array, or texts with a tokenizer that has a BOS to "
                             "pad them with")
        return self._rows[0]

    def _listing_tokenizer(self):
        """The `tokenizers.Tokenizer` that lists tokens (a fast Hugging Face one's backend), or None."""
        tokenizer = getattr(self._tokenizer, "backend_tokenizer", self._tokenizer)
        return tokenizer if hasattr(tokenizer, "id_to_token") else None

    def tables(self) -> dict[str, pd.DataFrame]:
        """Every circuit table of the layer (`interactions`, `gates`, `eigen`, `lowrank`, ...),
        for all output features at once, as the `circuits` stage computes them."""
        from pipelines.analysis.circuit_tables import analyse_layer

        if self._tables is None:
            self._tables = analyse_layer(from_hooked_transformer(self.model, self.layer), self.sae_in,
                                         self._outputs(), self.batches(), self.config, layer=self.layer,
                                         input_site=self.input_site)
        return self._tables

    def circuits(self) -> pd.DataFrame:
        """The layer's candidate AND-gate pairs ranked across the layer (`layer_rank`, by what
        they do on the tokens; then by weight score), descriptions joined."""
        gates = self.tables()["gates"]
        ranked = gates.sort_values(["layer_rank", "and_score"], ascending=[True, False], na_position="last")
        return with_descriptions(ranked.reset_index(drop=True), self.descriptions, self.input_site)

    def _submatrix(self, feature: int):
        from pipelines.report.inputs import interaction_submatrix

        return lambda inputs: interaction_submatrix(self.model, self.layer, feature, self._saes, inputs)


def _sae(sae, name: str):
    """(weights, (layer, site) or None) of an SAE given as an sae-lens `SAE`, our `LoadedSAE`,
    or `SAEWeights`."""
    from sae.io import LoadedSAE

    if isinstance(sae, SAEWeights):
        return sae, None
    if isinstance(sae, LoadedSAE):
        return sae.weights, sae.point
    if hasattr(sae, "cfg") and hasattr(sae, "W_enc"):
        try:
            weights = from_sae_lens(sae)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        hook = getattr(getattr(sae.cfg, "metadata", None), "hook_name", None)
        return weights, site_of_hook(hook) if hook else None
    raise ValueError(f"{name} must be an sae-lens SAE or circuits.SAEWeights, not {type(sae).__name__}")


def _loaded(weights: SAEWeights, point):
    from sae.io import LoadedSAE

    return LoadedSAE(weights, IN_MEMORY, "in-memory", point)


def bos_id(tokenizer) -> int | None:
    """The BOS token id of a `tokenizers.Tokenizer` or a Hugging Face tokenizer (None if none)."""
    from pipelines.data.tokenizer import BOS

    if tokenizer is None:
        return None
    if hasattr(tokenizer, "token_to_id"):
        return tokenizer.token_to_id(BOS)
    return getattr(tokenizer, "bos_token_id", None)


def encode_texts(texts: Sequence[str], tokenizer) -> tuple[list[list[int]], int | None]:
    """Token ids of each text after BOS (a document's start, as in training), and the BOS id."""
    bos = bos_id(tokenizer)
    head = [] if bos is None else [bos]
    if hasattr(tokenizer, "encode_batch"):
        found = [head + e.ids for e in tokenizer.encode_batch(list(texts))]
    else:
        found = [head + list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    return found, bos
