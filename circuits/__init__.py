"""Weight-based circuit analysis of bilinear MLPs in SAE feature bases (pure tensor math)."""

from circuits.layer import CircuitConfig, analyse_layer, write_layer_tables
from circuits.weights import MLPWeights, SAEWeights, from_hooked_transformer, from_sae_lens

__all__ = [
    "CircuitConfig",
    "MLPWeights",
    "SAEWeights",
    "analyse_layer",
    "from_hooked_transformer",
    "from_sae_lens",
    "write_layer_tables",
]
