"""Weight-based circuit analysis of bilinear MLPs in SAE feature bases (pure tensor math;
`pipelines.analysis.circuit_tables` turns it into tables)."""

from circuits.layer import CircuitConfig, LayerBatch, Outputs, hosvd_outputs
from circuits.weights import MLPWeights, SAEWeights, from_hooked_transformer, from_sae_lens

__all__ = [
    "CircuitConfig",
    "LayerBatch",
    "MLPWeights",
    "Outputs",
    "SAEWeights",
    "from_hooked_transformer",
    "from_sae_lens",
    "hosvd_outputs",
]
