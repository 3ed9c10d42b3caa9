"""Column names and types of the circuit tables `circuits.layer.analyse_layer` returns.

Feature indices are 0-based; ranks are 1-based (rank 1 is the strongest). The constant
coordinate of the input side (z'_{n_in} = 1) is written as index -1: a `linear` term is
(in_a=b, in_b=-1) and the `constant` term is (in_a=-1, in_b=-1). Every table says which
outputs it describes (`outputs`: `sae`, `sae-decoder`, `hosvd`, `logit:...`, `file:...`)
and where its input SAE reads (`input_site`: `resid_mid` or `mlp_in`).
"""

from __future__ import annotations

import pyarrow as pa

_KEYS = [("layer", pa.int64()), ("outputs", pa.string()), ("input_site", pa.string()), ("out_feature", pa.int64())]

SCHEMAS = {
    "interactions": pa.schema(_KEYS + [
        ("rank", pa.int64()),  # 1 = largest |coefficient| of this output feature and kind
        ("in_a", pa.int64()),
        ("in_b", pa.int64()),
        ("kind", pa.string()),  # self | cross | linear | constant
        ("coefficient", pa.float64()),  # multiplies z_a^2, z_a z_b, z_a or 1 respectively
    ]),
    "gates": pa.schema(_KEYS + [
        ("in_a", pa.int64()),
        ("in_b", pa.int64()),  # in_a < in_b
        ("and_score", pa.float64()),  # cross - |self_a| - |self_b|, from the weights alone
        ("cross", pa.float64()),  # coefficient of z_a z_b (2 Qt[a, b])
        ("self_a", pa.float64()),  # coefficient of z_a^2
        ("self_b", pa.float64()),
        ("weight_rank", pa.int64()),  # rank by and_score among the output's candidates
        ("n_active", pa.float64()),  # tokens where the output is active (data)
        ("coactivation", pa.float64()),  # share of those where a and b are both active
        ("mean_contribution", pa.float64()),  # mean of cross * z_a z_b * s over the output's active tokens
        ("contribution_share", pa.float64()),  # its sum over the sum of the output's activation there
        ("and_data", pa.float64()),  # (m11 - max(m10, m01, m00)) / m11 from the truth table
        ("n_both", pa.float64()),  # held-out tokens where a and b are both active
        ("n_a_only", pa.float64()),  # ... where a is active and b is not
        ("n_b_only", pa.float64()),  # ... where b is active and a is not
        ("gate_score", pa.float64()),  # contribution_share * and_data (clipped to [0, 1]); null unless the
        # output and both inputs were seen together and apart on at least min_active tokens each
        ("data_rank", pa.int64()),  # rank by gate_score among the output's candidates
        ("layer_rank", pa.int64()),  # rank of the output's best data pair within the layer (null otherwise)
    ]),
    "gate_truth": pa.schema(_KEYS + [
        ("in_a", pa.int64()),
        ("in_b", pa.int64()),
        ("layer_rank", pa.int64()),
        ("cell", pa.string()),  # on_on | on_off | off_on | off_off (input a, input b)
        ("n_tokens", pa.int64()),
        ("mean_activation", pa.float64()),  # of the output, over every token of the cell
        ("active_share", pa.float64()),  # share of the cell's tokens where the output is active
        ("quantile_activation", pa.float64()),  # upper quantile (CircuitConfig.truth_quantile)
    ]),
    "gate_ablation": pa.schema(_KEYS + [
        ("in_a", pa.int64()),
        ("in_b", pa.int64()),
        ("layer_rank", pa.int64()),
        ("ablated", pa.string()),  # a | b | both: what was removed from the MLP's input
        ("n_tokens", pa.int64()),  # held-out tokens where a and b are both active
        ("activation_before", pa.float64()),  # means over those tokens
        ("activation_after", pa.float64()),
        ("pre_before", pa.float64()),  # the output's pre-activation
        ("pre_after", pa.float64()),
        ("pre_change_predicted", pa.float64()),  # from the weights and the input SAE's reconstruction
        ("logprob_before", pa.float64()),  # mean next-token log-probability of the output's boosted tokens
        ("logprob_after", pa.float64()),
    ]),
    "eigen": pa.schema(_KEYS + [
        ("rank", pa.int64()),  # 1 = largest |eigenvalue|
        ("eigenvalue", pa.float64()),
        ("energy_share", pa.float64()),  # lambda^2 / sum of all lambda^2
        ("activation_share", pa.float64()),  # sum over active tokens of lambda (v . x)^2 / sum of the activation
    ]),
    "eigen_inputs": pa.schema(_KEYS + [
        ("eigen_rank", pa.int64()),  # which eigenvector (1 = largest |eigenvalue|)
        ("input_rank", pa.int64()),  # 1 = largest |cosine|
        ("in_feature", pa.int64()),
        ("cosine", pa.float64()),  # of the eigenvector with the input's normalised MLP-input direction
    ]),
    "lowrank": pa.schema(_KEYS + [
        ("n_eigs", pa.int64()),  # r: eigenpairs in the approximation
        ("n_active", pa.int64()),  # tokens where the feature is active
        ("corr_active", pa.float64()),  # Pearson over active tokens; NaN if too few
    ]),
    "lowrank_samples": pa.schema(_KEYS + [
        ("sample", pa.int64()),  # 1.. n_samples: a seeded random sample of the feature's active tokens
        ("n_eigs", pa.int64()),  # r: eigenpairs in the approximation
        ("activation", pa.float64()),  # the output feature's activation at that token
        ("approx", pa.float64()),  # sum of the r largest eigen-terms lambda (v . x)^2 there
        ("offset", pa.float64()),  # c_f with pre-activation = x^T Q x + c_f (encoder rows only; else null)
    ]),
    "hosvd": pa.schema([("layer", pa.int64()), ("outputs", pa.string()), ("input_site", pa.string()),
                        ("component", pa.int64()), ("singular_value", pa.float64())]),
}
