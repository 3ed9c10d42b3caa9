"""Every table a run writes, in one registry: columns with types and meanings, the columns
that identify a row, the order rows are written in, and the stage that writes the table.

Stages write through `write` (rows sorted, types fixed by the schema, nothing dropped
silently); the report, the explorer and the demo read with `read` and `select`; the docs'
tables reference is rendered from here when the site is built (`markdown`, called by
`docs/hooks.py`). A table's optional columns are written only where a run has them: the
gate tags a corpus supplies (`GATE_TAGS`, `pipelines.data.tags`). Feature indices are 0-based, ranks 1-based; the constant coordinate of
the input side is index -1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa

from circuits.sites import DEFAULT_INPUT_SITE
from pipelines.data.story_corpus import STORY_TAGS
from pipelines.data.tags import GateTag
from pipelines.engine.tables import read_table, write_table

INT, FLOAT, STR, BOOL = pa.int64(), pa.float64(), pa.string(), pa.bool_()
INTS, FLOATS, STRS = pa.list_(INT), pa.list_(FLOAT), pa.list_(STR)


@dataclass(frozen=True)
class Column:
    """One column, or several of one meaning (`types` one per name, or one for all)."""

    names: tuple[str, ...]
    types: tuple[pa.DataType, ...]
    doc: str

    def fields(self) -> list[tuple[str, pa.DataType]]:
        types = self.types if len(self.types) == len(self.names) else self.types * len(self.names)
        return list(zip(self.names, types))


def col(names: str, types: pa.DataType | tuple, doc: str) -> Column:
    """`col("in_a, in_b", INT, "...")`: a Column from a comma list of names."""
    return Column(tuple(n.strip() for n in names.split(",")), types if isinstance(types, tuple) else (types,), doc)


@dataclass(frozen=True)
class Table:
    """A table: where it comes from, what a row is, and its columns."""

    name: str
    stage: str  # the command whose stage writes it
    doc: str  # what one row is
    columns: tuple[Column, ...]  # the table's own columns; circuit tables also have CIRCUIT_KEYS first
    keys: tuple[str, ...]  # columns that identify a row
    sort: tuple[str, ...]  # the order rows are written in
    categories: tuple[str, ...] = ()  # string columns of a few values (the explorer writes them as codes)
    circuit: bool = True  # has the columns of CIRCUIT_KEYS
    outputs: str = "any"  # circuits stage: the output sets it is written for (`sae`: it measures their activity)
    optional: tuple[Column, ...] = ()  # columns a run's table has only when its corpus supplies them (last)

    @property
    def all_columns(self) -> tuple[Column, ...]:
        return (CIRCUIT_KEYS if self.circuit else ()) + self.columns

    @property
    def schema(self) -> pa.Schema:
        """The columns every run's table has."""
        return pa.schema([f for c in self.all_columns for f in c.fields()])

    def schema_with(self, columns) -> pa.Schema:
        """The schema of a table that has those of its optional columns among `columns`."""
        present = set(columns)
        return pa.schema([*self.schema, *(f for c in self.optional for f in c.fields() if f[0] in present)])

    @property
    def names(self) -> list[str]:
        return self.schema.names

    def empty(self) -> pd.DataFrame:
        return self.schema.empty_table().to_pandas()


CIRCUIT_KEYS = (
    col("layer", INT, "the layer"),
    col("outputs", STR, "which output directions: `sae`, `sae-decoder`, `hosvd`, `logit:...`, `file:...`"),
    col("input_site", STR, "where the input SAE reads: `resid_mid` or `mlp_in`"),
    col("out_feature", INT, "the output feature (or direction)"),
)
_CELLS = col("cell", STR, "`on_on`, `on_off`, `off_on`, `off_off` (input a, input b)")
_ABLATED = (
    col("ablated", STR, "`a`, `b` or `both`: what was removed from the MLP's input"),
    col("n_tokens", INT, "tokens ablated: a seeded sample of held-out tokens where both sides are on and the output is "
        "active (at most `--ablate-tokens`)"),
    col("activation_before, activation_after, pre_before, pre_after", FLOAT,
        "the output's activation and pre-activation, means"),
    col("pre_constant", FLOAT, "the output's pre-activation with no MLP input (the MLP's biases through the encoder): "
        "pre less it is the MLP output along the feature's encoder direction, before any TopK"),
    col("pre_change_predicted, activation_local", FLOAT, "the exact layer-local intervention on the same tokens "
        "(`circuits.gates.interventions`): the pre-activation change, and the activation after"),
    col("logprob_before, logprob_after", FLOAT, "mean next-token log-probability of the output's boosted tokens"),
    col("share_a, share_b, share_other, share_bias, share_error", FLOAT,
        "share of the output's quadratic form on those tokens from each part of the MLP input (see gate_verdicts)"),
)
_INTERVENTIONS = (
    col("iv_tokens", INT, "ranking tokens (never confirmation tokens) where both sides are on and the output is active "
        "on which the candidate was tested by exact layer-local intervention (at most `--iv-tokens`, or `--retest-tokens` "
        "for the shortlist that was retested; under `--min-cell`: untested)"),
    col("act_none, act_a, act_b, act_ab, pre_none, pre_a, pre_b, pre_ab", FLOAT,
        "the output's mean activation and pre-activation there with nothing, side A, side B or both removed from the "
        "MLP input (`circuits.gates.interventions`)"),
    col("pre_constant", FLOAT, "the output's pre-activation with no MLP input: the MLP's biases through the output "
        "SAE's encoder (`b_enc - W_enc^T (b_dec - b_mlp)`)"),
    col("form_self_a, form_self_b, form_own_a, form_own_b, form_cross, form_rest", FLOAT,
        "the exact parts of `pre_none - pre_constant` with the norm's factor frozen, means over the iv_tokens: each "
        "side's self term `x_S^T Q x_S`; each side's own terms (self term plus its products with the rest of the "
        "input, b_dec included); the cross term `2 x_A^T Q x_B`; the rest's own form. own_a + own_b + cross + rest = "
        "pre_none - pre_constant (`circuits.gates.interventions`, `LayerIntervention.form_parts`)"),
    col("cross_share, own_a_share, own_b_share, rest_share", FLOAT, "form_cross, form_own_a, form_own_b, form_rest "
        "over `pre_none - pre_constant` (they add up to 1; null where that is not positive or under a quarter of "
        "`|form_own_a| + |form_own_b| + |form_cross| + |form_rest|`): what the gate types read "
        "(`circuits.gates.types`)"),
    col("square_share, square_fit, square_part", FLOAT, "the 2x2 form on the sides (`form_self_a + form_self_b + "
        "form_cross`) over `pre_none - pre_constant`; `form_cross / (2 sqrt(form_self_a form_self_b))` signed by the "
        "self terms, 1 for a rank-one form, one direction squared (null unless the self terms share a sign); the "
        "smaller side's part of that direction, `sqrt|self|` over both sides' sum (`circuits.gates.types.form_shares`)"),
    col("layer_cross_share, layer_own_a_share, layer_own_b_share, layer_rest_share", FLOAT, "the closed form of "
        "pre_none, pre_a, pre_b, pre_ab less pre_constant (the norm's factor recomputed with each removal, as the "
        "layer computes it) over `pre_none - pre_constant`"),
    col("keep_a, keep_b, keep_ab, synergy", FLOAT, "`act_a / act_none`, ...: the share kept when a side leaves; "
        "`(f - f_a - f_b + f_ab) / f`, the cross term's share (`circuits.gates.types`)"),
    col("keep_a_se, keep_b_se, synergy_se", FLOAT, "standard errors of keep_a, keep_b and synergy over the iv_tokens "
        "(ratios of means, by the delta method: `circuits.gates.types.keep_errors`)"),
    col("causal_score", FLOAT, "`clip(1 - max(keep_a, keep_b), 0, 1) * clip(synergy, 0, 1)`"),
    col("causal_bound", FLOAT, "the causal score with keep_a and keep_b raised and synergy lowered by `--rank-z` "
        "standard errors, of the sample with `--null-tokens` of no effect added: what circuit_rank orders by"),
    col("sure_and", BOOL, "the activation-level AND rule holds with keep_a and keep_b raised and synergy lowered by "
        "`--rank-z` standard errors (null tokens added): ranked after the bilinear ands and before every other "
        "candidate (`circuits.gates.ranking`)"),
    col("gate_type", STR, "on the layer's pre-activation: `square` (a rank-one form on the sides' self terms and "
        "cross term, one direction squared) or `and` (the bilinear AND: cross_share, and removing either side, >= "
        "`--bilinear-cross`, rest_share <= 1 minus it, each own share within `--bilinear-own`); else on the "
        "activations: `xor-like`, `inhibition`, `and-unformed` (both sides necessary to the activation where the "
        "form's shares are null: the layer's part unknown), `threshold` (both sides necessary only through the output "
        "SAE's cut-off), `or`, `neither`, `one-sided`, `additive`; or `untested` (`circuits.gates.types`)"),
)
_RANKED = (
    col("split_pair", BOOL, "one concept split over two latents: a `square` (one direction squared), or the "
        "correlational evidence and not a bilinear `and` (`circuits.gates.ranking`)"),
    col("circuit_rank", INT, "rank in the layer of each output's circuit candidate: bilinear ands, then sure "
        "activation-level ands, each where and_data does not contradict it, then the rest, each by causal_bound; "
        "split ones last (`circuits.gates.ranking`; null otherwise)"),
)
_GROUPS = (
    col("group_a, group_b", INT, "the two input groups (ids within the layer, see group_gates)"),
)
_ORDER = ("layer", "input_site", "outputs", "out_feature")
# the label-based gate tags the corpora supply (`pipelines.data.tags`), each an optional gate_verdicts column;
# a corpus that brings a tag of its own adds it here
GATE_TAGS: tuple[GateTag, ...] = STORY_TAGS


def _tag_column(tag: GateTag) -> Column:
    channels = ", ".join(f"`{c}`" for c in tag.channels)
    return col(tag.column, BOOL, f"{tag.doc} (gate tag of `{tag.rule.__module__}`: only when the corpus's feature "
               f"labels have the channels {channels})")

TABLES: dict[str, Table] = {t.name: t for t in (
    Table("sae_metrics", "train-saes", "one SAE", circuit=False, keys=("layer", "site"), sort=("layer", "site"), columns=(
        col("layer, d_in, d_sae, k, train_tokens, eval_tokens", INT, "one row per SAE"),
        col("site, hook", STR, "its site and TransformerLens hook"),
        col("nmse", FLOAT, "`sum |x - x_hat|^2 / sum |x - mean x|^2` on held-out tokens"),
        col("l0, dead_fraction", FLOAT, "mean active latents; share never active on held-out tokens"),
        col("loss_clean, loss_patched, loss_added", FLOAT,
            "next-token loss without/with the reconstruction spliced in; `(patched - clean) / clean`"),
    )),
    Table("interactions", "circuits", "one term of an output's quadratic form", keys=(*_ORDER, "kind", "rank"),
          sort=(*_ORDER, "kind", "rank"), categories=("kind",), columns=(
        col("rank", INT, "rank within its kind, 1 = largest |coefficient| (top N of each kind kept)"),
        col("in_a, in_b", INT, "input features (`linear`: in_b = -1; `constant`: both -1)"),
        col("kind", STR, "`self`, `cross`, `linear` or `constant`"),
        col("coefficient", FLOAT, "multiplies `z_a^2`, `z_a z_b`, `z_a` or 1"),
    )),
    Table("gates", "circuits", "a candidate input pair of an output", keys=(*_ORDER, "in_a", "in_b"),
          sort=(*_ORDER, "weight_rank"), columns=(
        col("in_a, in_b", INT, "candidate pair, in_a < in_b"),
        col("and_score", FLOAT, "`cross - |self_a| - |self_b|`, weights only"),
        col("cross, self_a, self_b", FLOAT, "coefficients of `z_a z_b`, `z_a^2`, `z_b^2`"),
        col("weight_rank", INT, "rank by and_score among the output's candidates"),
        col("input_cosine", FLOAT, "cosine of the two inputs' MLP-input directions (`g * d`, or `d` on mlp_in)"),
        col("n_active", FLOAT, "held-out tokens where the output is active"),
        col("coactivation", FLOAT, "share of those where a and b are both active"),
        col("coactivation_lift", FLOAT, "`P(a and b) / (P(a) P(b))` over all held-out tokens (1: independent)"),
        col("mean_contribution, contribution_share", FLOAT,
            "the cross term on the output's active tokens: mean, and sum over the activation's sum"),
        col("and_data", FLOAT, "`(m11 - max(m10, m01, m00)) / m11` from the truth table's means"),
        col("n_both, n_a_only, n_b_only", FLOAT, "held-out tokens with both inputs active, only a, only b"),
        col("gate_score", FLOAT, "`contribution_share * and_data`; null unless seen together and apart"),
        col("data_rank, layer_rank", INT,
            "rank by gate_score within the output, and of the output's best pair within the layer (null otherwise)"),
    )),
    Table("gate_truth", "circuits", "one cell of a candidate's truth table", keys=(*_ORDER, "in_a", "in_b", "cell"),
          sort=(*_ORDER, "in_a", "in_b"), categories=("cell",), outputs="sae", columns=(  # cells in their own order
        col("in_a, in_b, layer_rank", INT, "the candidate (each output's `--n-truth` best data-ranked pairs) and its "
            "layer_rank (null but for each output's best pair)"),
        _CELLS,
        col("n_tokens", INT, "held-out tokens in the cell"),
        col("mean_activation, active_share, quantile_activation", FLOAT,
            "the output over the cell: mean, share active, upper quantile (`--truth-quantile`)"),
    )),
    Table("eigen", "circuits", "an eigenvalue of an output's interaction matrix", keys=(*_ORDER, "rank"),
          sort=(*_ORDER, "rank"), columns=(
        col("rank", INT, "1 = largest |eigenvalue|"),
        col("eigenvalue, energy_share", FLOAT, "eigenvalue of `Q_u`; `lambda^2 / sum lambda^2`"),
        col("activation_share", FLOAT,
            "over active tokens, `sum lambda (v . x)^2 / sum activation` (ranks up to max_rank)"),
    )),
    Table("eigen_inputs", "circuits", "an input feature a top eigenvector reads",
          keys=(*_ORDER, "eigen_rank", "input_rank"), sort=(*_ORDER, "eigen_rank", "input_rank"), columns=(
        col("eigen_rank, input_rank, in_feature", INT,
            "an eigenvector, and an input feature it reads (1 = largest |cosine|)"),
        col("cosine", FLOAT, "with the input's normalised MLP-input direction (the eigenvector's sign makes the first positive)"),
    )),
    Table("lowrank", "circuits", "an output feature's correlation at one rank", keys=(*_ORDER, "n_eigs"),
          sort=(*_ORDER, "n_eigs"), outputs="sae", columns=(
        col("n_eigs", INT, "r, eigenpairs used"),
        col("n_active", INT, "tokens where the feature is active"),
        col("corr_active", FLOAT, "Pearson over active tokens (NaN if too few)"),
    )),
    Table("lowrank_samples", "circuits", "one sampled active token of an output feature, at one rank",
          keys=(*_ORDER, "sample", "n_eigs"), sort=(*_ORDER, "n_eigs", "sample"), outputs="sae", columns=(
        col("sample, n_eigs", INT, "one of `--n-samples` active tokens per feature (a seeded random sample), and r"),
        col("activation, approx", FLOAT,
            "the feature's activation there; the sum of its r largest eigen-terms `lambda (v . x)^2`"),
        col("offset", FLOAT, "`c_f` with pre-activation `= x^T Q x + c_f` (encoder rows; null otherwise): "
            "`approx + offset` reaches the activation at full rank"),
    )),
    Table("hosvd", "circuits", "an HOSVD component", circuit=False, keys=("layer", "input_site", "component"),
          sort=("layer", "input_site", "component"), outputs="hosvd", columns=(
        col("layer", INT, "the layer"),
        col("outputs, input_site", STR, "`hosvd`, and the input site"),
        col("component", INT, "`--outputs hosvd`: the out_feature of the other tables"),
        col("singular_value", FLOAT, "of B reshaped to (d_out, d_in^2)"),
    )),
    Table("features", "features", "one SAE feature", circuit=False, keys=("layer", "site", "feature"),
          sort=("layer", "site", "feature"), categories=("site",), columns=(
        col("layer, feature", INT, "SAE feature"),
        col("site", STR, "`resid_mid`, `mlp_in` or `mlp_out`"),
        col("frequency, max_activation, mean_activation", FLOAT,
            "share of held-out tokens active; max; mean over active ones"),
        col("top_contexts, top_tokens", STRS,
            "best-activating windows, one per document, active token in `[brackets]`; the tokens"),
        col("top_documents", INTS, "the document of each"),
        col("sample_contexts, sample_quantiles", (STRS, FLOATS),
            "windows at spread activation quantiles, and the quantile of each"),
        col("top_token, top_token_share, is_token_feature", (STR, FLOAT, BOOL),
            "the token carrying most of the activation; a token feature when its share is >= `--token-feature-share`"),
        col("boosted_tokens, suppressed_tokens", STRS, "`mlp_out`: direct logit effects, special and untrained tokens left out"),
        col("label, label_share", (STR, FLOAT), "the label class with most of the activation (null without labels)"),
        col("boost_label, boost_sd", (STR, FLOAT), "`mlp_out` with a lexicon: the class boosted most, in sd (null otherwise)"),
        col("description", STR, "a short label made from the above"),
    )),
    Table("feature_labels", "features", "a feature's share of one label class, or its boost of one lexicon class",
          circuit=False, keys=("layer", "site", "feature", "kind", "channel", "class"),
          sort=("layer", "site", "feature", "kind", "channel", "class"), categories=("site", "channel", "class", "kind"),
          columns=(
        col("layer, feature", INT, "SAE feature"),
        col("site, channel, class, kind", STR, "`kind` is `activation_share` or `logit_boost`"),
        col("value", FLOAT, "share of the feature's activation on the class's tokens, or boost in sd"),
        col("lift", FLOAT, "activation_share: the share over the class's share of all tokens"),
        col("n_tokens", INT, "logit_boost: the class's tokens behind the mean"),
    )),
    Table("gate_ablation", "verdicts", "one ablation of a checked pair", keys=(*_ORDER, "in_a", "in_b", "ablated"),
          sort=(*_ORDER, "in_a", "in_b", "ablated"), categories=("ablated",), columns=(
        col("in_a, in_b", INT, "the pair"),
        *_ABLATED,
    )),
    Table("pair_gates", "verdicts", "a candidate pair of `gates`, tested by intervention",
          keys=(*_ORDER, "in_a", "in_b"), sort=(*_ORDER, "in_a", "in_b"), categories=("gate_type",), columns=(
        col("in_a, in_b", INT, "the pair"),
        col("gate_score, and_data, contribution_share, coactivation, coactivation_lift, input_cosine", FLOAT,
            "as in gates"),
        col("n_both, n_a_only, n_b_only", FLOAT, "as in gates"),
        col("same_top_token", BOOL, "the inputs have the same features.top_token"),
        *_INTERVENTIONS,
        *_RANKED,
    )),
    Table("group_gates", "verdicts", "a gate of an output between two groups of inputs",
          keys=(*_ORDER, "group_a", "group_b"), sort=(*_ORDER, "group_a", "group_b"), categories=("source",), columns=(
        *_GROUPS,
        col("source", STR, "`eigen` (the best split of what one eigenvector reads) or `labels` (two label classes)"),
        col("eigen_rank", INT, "`eigen`: the eigenvector (null for `labels`)"),
        col("label_a, label_b", STR, "the groups' label class, several joined by ` | ` when they hold the same "
            "inputs (`eigen`: the label of most members, else null)"),
        col("members_a, members_b", INTS, "the input features of each group"),
        col("n_active", INT, "held-out tokens where the output is active"),
        col("coactivation", FLOAT, "share of those where both groups are on (a group is on where any member is active)"),
        col("contribution_share", FLOAT, "the cross terms between the groups on the output's active tokens, over its "
            "summed activation there"),
        col("and_data", FLOAT, "`(m11 - max(m10, m01, m00)) / m11` from the group truth table's means"),
        col("n_both, n_a_only, n_b_only", INT, "held-out tokens with both groups on, only A, only B"),
        col("gate_score", FLOAT, "`contribution_share * and_data`; null unless seen together and apart"),
        col("split_share", FLOAT, "`eigen`: share of the cross terms carried by split member pairs (null for `labels`); "
            "at least 0.5 is the split rule's evidence"),
        *_INTERVENTIONS,
        col("necessary_a, necessary_b", INTS, "each side pruned to the members whose leaving it changes the gate's "
            "intervention result by at least `--prune` of the output, a cut taken only when the pruned gate keeps "
            "what the whole groups kept within `--prune` (`pipelines.analysis.interventions.pruned_groups`): the "
            "sides the interventions, the ranking and the model-run confirmation use"),
        *_RANKED,
    )),
    Table("group_truth", "verdicts", "one cell of a group gate's truth table",
          keys=(*_ORDER, "group_a", "group_b", "cell"), sort=(*_ORDER, "group_a", "group_b"),
          categories=("cell",), columns=(
        *_GROUPS,
        _CELLS,
        col("n_tokens", INT, "held-out tokens in the cell"),
        col("mean_activation, active_share", FLOAT, "the output over the cell: mean, share active"),
    )),
    Table("group_ablation", "verdicts", "one ablation of a checked group gate",
          keys=(*_ORDER, "group_a", "group_b", "ablated"), sort=(*_ORDER, "group_a", "group_b", "ablated"),
          categories=("ablated",), columns=(
        *_GROUPS,
        *_ABLATED,
    )),
    Table("gate_verdicts", "verdicts", "an output's circuit candidate (its best pair, or its best group gate, by "
          "circuit_rank's order) and the split candidates that outscore it",
          keys=(*_ORDER, "kind", "in_a", "in_b", "group_a", "group_b"),
          sort=("layer", "input_site", "outputs", "kind", "circuit_rank"),
          categories=("kind",), columns=(
        col("kind", STR, "`pair` or `group`"),
        col("circuit_rank", INT, "rank in the layer among candidates of its kind, as in pair_gates"),
        col("in_a, in_b", INT, "`pair`: the inputs (null for groups)"),
        col("group_a, group_b", INT, "`group`: the groups (ids of group_gates; null for pairs)"),
        col("members_a, members_b", INTS, "the inputs of each side"),
        col("label_a, label_b", STR, "each side's label class, if any"),
        col("gate_score, contribution_share, coactivation, and_data", FLOAT, "as in gates and group_gates"),
        col("both_tokens, apart_tokens", INT, "held-out tokens with both sides on; the fewer of those with one side on "
            "alone"),
        col("same_top_token", BOOL, "`pair`: the inputs have the same features.top_token"),
        col("input_cosine, coactivation_lift", FLOAT, "`pair`: as in gates"),
        col("split_pair", BOOL, "one concept split over two latents (`circuits.gates.ranking`)"),
        col("keep_a, keep_b, keep_ab, synergy, causal_score, causal_bound", FLOAT, "the interventions, as in pair_gates"),
        col("sure_and", BOOL, "as in pair_gates"),
        col("cross_share, own_a_share, own_b_share, rest_share, square_fit", FLOAT, "the layer's pre-activation, as "
            "in pair_gates"),
        col("gate_type", STR, "as in pair_gates"),
        col("necessary_a, necessary_b", INTS, "`group`: as in group_gates (null for pairs)"),
        col("drop_a, drop_b, drop_both", FLOAT, "share of the output's activation the model-run ablation removed on "
            "confirmation tokens (null if not ablated)"),
        col("mlp_keep_a, mlp_keep_b, mlp_keep_both", FLOAT, "share of the MLP output along the feature's encoder "
            "direction (pre-activation less pre_constant, no TopK) the model-run ablation kept (null if not ablated)"),
        col("logprob_drop_a, logprob_drop_b, logprob_drop_both", FLOAT, "how much the ablation lowered the mean "
            "log-probability of the output's boosted tokens downstream (null if not ablated or none boosted)"),
        col("sae_confirms, mlp_confirms, logprob_confirms", BOOL, "the model run says both sides are necessary: by the "
            "SAE's activation (each drop at least 1 - need), by the MLP output with no TopK (each mlp_keep at most "
            "need), by the log-probability (removing both lowers it, each side alone at least 1 - need of that) "
            "(`pipelines.analysis.verdicts.confirmations`; null where not measured)"),
        col("mlp_disagrees, logprob_disagrees", BOOL, "that measure says otherwise than sae_confirms: an mlp "
            "disagreement is a side necessary only through the SAE's cut-off, or the reverse"),
        col("ablation_tokens", INT, "tokens the ablations ran on"),
        col("share_a, share_b, share_other, share_bias, share_error", FLOAT,
            "share of the output's quadratic form on those tokens from side A's part of the MLP input, side B's, the "
            "other inputs', b_dec's and the SAE's reconstruction error (they add up to 1)"),
        col("truth, verdict", STR, "what the truth table says; the verdict"),
        col("truth_and, is_and", BOOL, "the truth table says AND; the candidate behaves as an AND gate (a bilinear "
            "`and` by intervention that the model run confirms by the MLP output, mlp_confirms)"),
        col("out_description, a_description, b_description", STR, "the features' descriptions"),
    ), optional=tuple(_tag_column(tag) for tag in GATE_TAGS)),
    Table("graph_nodes", "graph", "a node of a prompt's attribution graph (all nodes, pruned or not)", circuit=False,
          keys=("prompt", "node_id"), sort=("prompt", "viewer_row", "pos", "node_id"), categories=("kind", "site"),
          columns=(
        col("prompt, node_id", STR, "the prompt's slug (its JSON file in graphs/); the node's id there"),
        col("kind", STR, "`token`, `input` (input SAE latent), `output` (mlp_out SAE latent), `input_error`, "
            "`output_error` (a layer without SAEs: its whole MLP output), `logit`"),
        col("layer, viewer_row, pos, feature", INT, "model layer (-1 tokens, n_layers logits); the viewer's row (2 layer "
            "for inputs, 2 layer + 1 for outputs); position; SAE latent (-1 for others)"),
        col("site, token", STR, "`embed`, the input SAE's site, `mlp_out` or `logits`; the token at pos (a logit's target)"),
        col("value, constant, incoming", FLOAT, "pre-activation (features) or demeaned logit; the constant term; the "
            "sum of incoming edges (value = incoming + constant for every target)"),
        col("influence, kept", (FLOAT, BOOL), "circuit-tracer's cumulative influence share; kept by pruning"),
        col("path_step", INT, "step on the strongest path from a token to the first target logit (0: the token; "
            "-1: not on it)"),
        col("description", STR, "the viewer's label (clerp), from the features table"),
    )),
    Table("graph_edges", "graph", "an edge pruning kept: the exact direct effect of source on target", circuit=False,
          keys=("prompt", "source", "target"), sort=("prompt", "target", "source"), columns=(
        col("prompt, source, target", STR, "the prompt's slug; node ids (graph_nodes)"),
        col("weight", FLOAT, "what the source adds to the target's value (circuit-tracer's edge weight)"),
    )),
    Table("graph_and_edges", "graph", "an AND hyperedge: the cross term of two MLP-input parts in an output "
          "feature's quadratic form", circuit=False, keys=("prompt", "target", "rank"), sort=("prompt", "target", "rank"),
          columns=(
        col("prompt, target, source_a, source_b", STR, "the prompt's slug; the output feature; the two parts (input "
            "latents or input errors of its layer and position)"),
        col("weight", FLOAT, "`2 x_a^T Q x_b`: what the two add together beyond each alone (their four-point synergy)"),
        col("rank", INT, "rank within the target, 1 = largest |weight|"),
    )),
)}


def write(frame: pd.DataFrame, root: str | Path, name: str, layer: int | None = None, part: str = "part",
          provenance: dict | None = None) -> Path:
    """Write table `name`'s rows in its sort order with its schema (see `pipelines.engine.tables`);
    rows whose keys repeat are an error."""
    table = TABLES[name]
    if layer is not None:
        frame = frame.assign(layer=int(layer))
    keys = list(table.keys)
    complete = set(keys) <= set(frame.columns)  # else write_table names the missing columns
    repeated = frame[frame.duplicated(subset=keys, keep=False)] if complete and len(frame) else frame.iloc[:0]
    if len(repeated):
        raise ValueError(f"table {name}: {len(repeated)} rows share their keys {keys} with another row, e.g. "
                         f"{repeated[keys].iloc[0].to_dict()}")
    order = [c for c in table.sort if c in frame.columns]
    frame = frame.sort_values(order, kind="stable").reset_index(drop=True) if order and len(frame) else frame
    return write_table(frame, root, name, layer, table.schema_with(frame.columns), part=part, provenance=provenance)


def read(root: str | Path, name: str, layers: list[int] | None = None) -> pd.DataFrame | None:
    """Table `name` of the run's tables folder `root` (only `layers`), or None when absent."""
    try:
        return read_table(root, name, layers)
    except FileNotFoundError:
        return None


def select(frame: pd.DataFrame | None, input_site: str | None = DEFAULT_INPUT_SITE, outputs: str | None = "sae"):
    """The rows of a circuit table for one input site and output set (a run may hold several;
    None keeps every one). Tables without those columns are returned as they are."""
    if frame is None:
        return None
    keep = pd.Series(True, index=frame.index)
    if input_site is not None and "input_site" in frame.columns:
        keep &= frame["input_site"] == input_site
    if outputs is not None and "outputs" in frame.columns:
        keep &= frame["outputs"] == outputs
    return frame[keep].reset_index(drop=True)


# ------------------------------------------------------------------ the docs' reference


def _type(t: pa.DataType) -> str:
    return f"list<{_type(t.value_type)}>" if pa.types.is_list(t) else {"double": "float64"}.get(str(t), str(t))


def markdown() -> str:
    """The table of tables for the docs: one row per column group, the circuit keys left out,
    an optional column after the others, marked so."""
    lines = ["| table | written by | column | type | meaning |", "|---|---|---|---|---|"]
    for table in TABLES.values():
        for i, c in enumerate(table.columns + tuple(Column(o.names, o.types, f"optional: {o.doc}")
                                                    for o in table.optional)):
            types = ", ".join(dict.fromkeys(_type(t) for _, t in c.fields()))
            first = (f"{table.name}", f"`{table.stage}`") if i == 0 else ("", "")
            doc = c.doc.replace("|", "\\|")  # a bar inside a cell would end it
            lines.append(f"| {first[0]} | {first[1]} | {', '.join(c.names)} | {types} | {doc} |")
    return "\n".join(lines)
