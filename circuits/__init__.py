"""Weight-based circuit analysis of bilinear MLPs in SAE feature bases (pure tensor math)."""

from circuits.layer import CircuitConfig, LayerBatch, Outputs, analyse_layer, hosvd_outputs
from circuits.weights import MLPWeights, SAEWeights, from_hooked_transformer, from_sae_lens

__all__ = [
    "CircuitConfig",
    "LayerBatch",
    "MLPWeights",
    "Outputs",
    "SAEWeights",
    "analyse_layer",
    "from_hooked_transformer",
    "from_sae_lens",
    "hosvd_outputs",
]
