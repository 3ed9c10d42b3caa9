"""Output directions in mlp_out, named on the command line (`--outputs`).

- `sae`: the output SAE's features, read by its encoder rows (`--output-basis encoder`,
  exactly the features' pre-activations) or written by its decoder rows (`decoder`);
- `hosvd`: the layer's top HOSVD directions (no output SAE needed);
- `logit:WORD` or `logit:GOOD-BAD` (several words joined by `+`): the token unembedding
  direction, or the difference of two, seen through the final norm's gain `g_f`:
  `u = g_f * (W_U[:, good] - W_U[:, bad])`. Then `u . mlp_out / rms_final` is the MLP's
  direct effect on that logit (difference), where `rms_final` is the RMS of the final
  residual stream: a positive per-token factor that scales magnitudes, not patterns;
- `file:PATH`: directions `[n, d_model]` (or one `[d_model]`) from a `.npy` or
  `.safetensors` file (a single tensor, or one named `directions`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from circuits.layer import CircuitConfig, Outputs, hosvd_outputs
from circuits.sae_basis import output_directions
from circuits.weights import MLPWeights
from pipelines.data.tokenizer import WORD_START
from pipelines.inputs import SAE_OUTPUTS, LayerSAEs, ModelInputs, outputs_name


def parse_outputs(specs: list[str], basis: str, inputs: ModelInputs, mlp: MLPWeights, saes: LayerSAEs,
                  cfg: CircuitConfig) -> list[Outputs]:
    """The `Outputs` of each spec (see the module docstring)."""
    out = []
    for spec in specs:
        if spec == SAE_OUTPUTS:
            w = saes.sae_out.weights
            out.append(Outputs(outputs_name(spec, basis), output_directions(w.W_enc, w.W_dec, basis), sae=w))
        elif spec == "hosvd":
            out.append(hosvd_outputs(mlp, cfg.n_hosvd))
        elif spec.startswith("logit:"):
            out.append(Outputs(spec, logit_direction(spec[6:], inputs.model, inputs.tokenizer)[None]))
        elif spec.startswith("file:"):
            out.append(Outputs(spec, file_directions(Path(spec[5:]), mlp.W_out.shape[1])))
        else:
            raise ValueError(f"unknown --outputs entry {spec!r}: use sae, hosvd, logit:GOOD-BAD or file:PATH")
    return out


def token_id(tok, word: str) -> int:
    """The id of `word` as one whole-word token; ValueError naming its pieces otherwise."""
    for piece in (word, WORD_START + word, WORD_START + word.lower()):
        index = tok.token_to_id(piece)
        if index is not None:
            return index
    pieces = tok.encode(word).tokens
    raise ValueError(f"logit output: {word!r} is not one token of the model's vocabulary (it splits into {pieces})")


def logit_direction(expression: str, model, tok) -> torch.Tensor:
    """`g_f * (sum of W_U columns of the words before '-' minus those after)`, `[d_model]`."""
    plus, _, minus = expression.partition("-")
    if not plus:
        raise ValueError(f"logit output {expression!r} names no word")
    W_U = model.W_U.detach()
    direction = sum(W_U[:, token_id(tok, w)] for w in plus.split("+"))
    if minus:
        direction = direction - sum(W_U[:, token_id(tok, w)] for w in minus.split("+"))
    gain = getattr(model.ln_final, "w", None)
    return direction if gain is None else gain.detach() * direction


def file_directions(path: Path, d_model: int) -> torch.Tensor:
    """Directions `[n, d_model]` from a `.npy` or `.safetensors` file."""
    if not path.is_file():
        raise FileNotFoundError(f"output directions file {path} does not exist")
    if path.suffix == ".npy":
        array = torch.from_numpy(np.load(path, allow_pickle=False))
    elif path.suffix == ".safetensors":
        tensors = load_file(str(path))
        if "directions" in tensors:
            array = tensors["directions"]
        elif len(tensors) == 1:
            array = next(iter(tensors.values()))
        else:
            raise ValueError(f"{path} holds several tensors ({sorted(tensors)}); name the one to use 'directions'")
    else:
        raise ValueError(f"output directions file {path} must be .npy or .safetensors")
    array = array.float()
    if array.ndim == 1:
        array = array[None]
    if array.ndim != 2 or array.shape[1] != d_model:
        raise ValueError(f"{path} holds shape {tuple(array.shape)}; directions must be [n, {d_model}]")
    if not torch.isfinite(array).all():
        raise ValueError(f"{path} holds NaN or Inf")
    return array
