"""The bilinear language model: build, save and load.

This is the one module that makes TransformerLens models, so it is also where the
identity activation is registered: TransformerLens 3.9 has none, and a gated MLP with an
identity activation is exactly a bilinear MLP, `W_out^T ((W_gate^T x) * (W_in^T x)) + b`.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from circuits.config import Config, option, seed_option
from circuits.weights import check_finite
from pipelines.engine.files import digest, text_digest, write_json
from pipelines.engine.paths import MODEL_CONFIG, MODEL_WEIGHTS, ModelPaths

if TYPE_CHECKING:  # for annotations: the functions that make a model import it themselves
    from transformer_lens import HookedTransformer, HookedTransformerConfig


def identity(x: torch.Tensor) -> torch.Tensor:
    """The activation of a bilinear MLP: none at all."""
    return x


def _register_identity() -> None:
    """Teach TransformerLens (3.9 has no identity activation) the bilinear MLP's, once, where
    a model's config is made rather than as a side effect of importing this module (which
    the command line's parser does: TransformerLens takes seconds to import)."""
    from transformer_lens.utilities.activation_functions import SUPPORTED_ACTIVATIONS

    SUPPORTED_ACTIVATIONS.setdefault("identity", identity)

@dataclass(frozen=True)
class ModelConfig(Config):
    """Shape of a bilinear LM; everything else (RMS norm, rotary, gated MLP) is fixed."""

    n_layers: int = option(4, "transformer blocks", low=1)
    d_model: int = option(128, "residual stream width", low=2)
    n_heads: int = option(4, "attention heads per block", low=1)
    d_mlp: int = option(512, "hidden width of each bilinear MLP", low=1)
    n_ctx: int = option(128, "longest context the model is built for", low=2)
    d_vocab: int = option(4096, "vocabulary size, taken from the tokenizer when training", low=2)
    eps: float = option(1e-5, "added to mean(x^2) inside every RMS norm", low=0.0)
    seed: int = seed_option("the seed its weights were initialised with (train-lm's --seed, recorded here)")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def check(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(n_layers=2, d_model=32, n_heads=2, d_mlp=64, n_ctx=64),
    "demo": ModelConfig(n_layers=4, d_model=128, n_heads=4, d_mlp=512, n_ctx=128),
    # the paper's TinyStories model (ts-medium): 6 layers, d_model 512, d_mlp 2048, 8 heads
    "paper": ModelConfig(n_layers=6, d_model=512, n_heads=8, d_mlp=2048, n_ctx=256),
}


def hooked_config(cfg: ModelConfig, seed: int | None = None, device: str = "cpu") -> HookedTransformerConfig:
    """The TransformerLens config of a bilinear LM of shape `cfg` on `device` (left unsaid,
    TransformerLens would name CUDA wherever torch sees one, wherever the model is)."""
    from transformer_lens import HookedTransformerConfig

    _register_identity()
    return HookedTransformerConfig(
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        d_head=cfg.d_head,
        d_mlp=cfg.d_mlp,
        n_ctx=cfg.n_ctx,
        d_vocab=cfg.d_vocab,
        eps=cfg.eps,
        act_fn="identity",
        gated_mlp=True,
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_dim=cfg.d_head,
        rotary_base=10000,
        seed=seed,  # TransformerLens seeds torch, numpy and random globally from it
        default_prepend_bos=False,
        model_name="bilinear-lm",
        device=device,
    )


def build_model(cfg: ModelConfig, device: str = "cpu", seed: int | None = None) -> HookedTransformer:
    """A freshly initialised bilinear LM on `device`. `seed` seeds the initialisation (and
    torch's, numpy's and random's global generators, as TransformerLens does); None draws it
    from torch's generator and then puts that generator back as it was (for weights that
    are loaded next, or set by hand)."""
    from transformer_lens import HookedTransformer

    # HookedTransformer warns that it goes away in TransformerLens 4; we pin 3.9 because
    # sae-lens 6.54 needs it, so the warning says nothing the user can act on.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")
        with torch.random.fork_rng(devices=[]) if seed is None else contextlib.nullcontext():
            model = HookedTransformer(hooked_config(cfg, seed, device), move_to_device=False)
    return model.to(device, print_details=False) if device != "cpu" else model


def save_model(model: HookedTransformer, cfg: ModelConfig, directory: str | Path) -> None:
    """Write `config.json` and `model.safetensors` into `directory` (the tokenizer is saved
    by its owner); callers make the folder appear atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(ModelPaths(directory).weights))
    write_json(ModelPaths(directory).config, cfg.to_json())


def model_digest(directory: str | Path) -> str:
    """Content digest of a model: its config and weights (not where they lie)."""
    directory = Path(directory)
    return text_digest(digest(ModelPaths(directory).config), digest(ModelPaths(directory).weights))


def load_config(directory: str | Path) -> ModelConfig:
    path = ModelPaths(directory).config
    if not path.is_file():
        raise FileNotFoundError(f"no model checkpoint at {directory}: {MODEL_CONFIG} is missing")
    try:
        return ModelConfig.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise ValueError(f"corrupt model config {path}: {err}") from err


def load_model(directory: str | Path, device: str = "cpu") -> tuple[HookedTransformer, ModelConfig]:
    """Load a checkpoint in our format; clear errors for missing or corrupt files."""
    directory = Path(directory)
    cfg = load_config(directory)
    weights = ModelPaths(directory).weights
    if not weights.is_file():
        raise FileNotFoundError(f"no model checkpoint at {directory}: {MODEL_WEIGHTS} is missing")
    try:
        state = load_file(str(weights), device=device)
    except Exception as err:  # safetensors raises several types for a damaged file
        raise ValueError(f"corrupt model weights {weights}: {err}") from err
    # IGNORE is TransformerLens's constant -inf attention fill, not a weight
    check_finite({k: v for k, v in state.items() if not k.endswith(("IGNORE", ".mask"))}, f"model {directory}")
    model = build_model(cfg)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatches
        raise ValueError(f"checkpoint {weights} does not match its config: {err}") from err
    missing = [k for k in missing if not k.endswith(("IGNORE", ".mask"))]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {weights} does not match its config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    return model.to(device, print_details=False).eval(), cfg
