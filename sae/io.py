"""SAEs on disk: ours (sae-lens's format plus our config and metrics) and the paper authors'.

Formats read, detected by their files:

- sae-lens (`cfg.json`, `sae_weights.safetensors`): TopK and ReLU SAEs, loaded through
  sae-lens itself; the hook it reads is `cfg.metadata.hook_name`. Ours are such folders,
  with `train_config.json` (the recipe), `metrics.json` and `sparsity.safetensors` beside.
- the paper authors' (`config.json` with `point`, `k`, ..., `model.safetensors` with
  `w_enc.weight [d_sae, d]`, `w_dec.weight [d, d_sae]`, `b_dec [d]`, `w_enc.bias` when
  `encoder_bias`): encoding keeps the top k *raw* values of `w_enc(x / normalize - b_dec)`
  (no ReLU, so activations can be negative), decoding is `(w_dec z + b_dec) * normalize`.
  `normalize` is folded into the weights, which is exact. Their point names
  (`resid-mid`, `mlp-in`, `mlp-out`) map to our sites.

Every load checks the weights are finite and returns the SAE as `SAEWeights` with the
(layer, site) it records, so callers can refuse an SAE used where it does not belong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from circuits.weights import SAEWeights, check_finite, from_sae_lens
from circuits.sites import SITES, Point, hook_name, site_of_hook

SAE_LENS_FILES = ("cfg.json", "sae_weights.safetensors")
AUTHORS_CONFIG, AUTHORS_WEIGHTS = AUTHORS_FILES = ("config.json", "model.safetensors")
TRAIN_CONFIG_FILE = "train_config.json"  # ours, beside sae-lens's files
METRICS_FILE = "metrics.json"
SPARSITY_FILE = "sparsity.safetensors"
AUTHORS_POINTS = {spelling: site for site in SITES for spelling in (site, site.replace("_", "-"))}


@dataclass
class LoadedSAE:
    """An SAE read from disk: its weights and what it says it reads."""

    weights: SAEWeights
    path: Path
    format: str  # "sae-lens" or "authors"
    point: Point | None  # (layer, site) it was trained on, None when it records no hook

    @property
    def description(self) -> str:
        if self.point is None:
            return f"{self.path} (records no hook)"
        return f"{self.path} ({hook_name(*self.point)})"


def sae_format(path: str | Path) -> str:
    """`sae-lens` or `authors`, from the files in the folder; FileNotFoundError otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no SAE at {path}: not a folder")
    if all((path / f).is_file() for f in SAE_LENS_FILES):
        return "sae-lens"
    if all((path / f).is_file() for f in AUTHORS_FILES):
        return "authors"
    found = sorted(p.name for p in path.iterdir())
    raise FileNotFoundError(f"no SAE at {path}: expected sae-lens's {' + '.join(SAE_LENS_FILES)} or the paper "
                            f"authors' {' + '.join(AUTHORS_FILES)}, found {found}")


def load_sae(path: str | Path, device: str = "cpu") -> LoadedSAE:
    """Load an SAE in either format (see the module docstring)."""
    path = Path(path)
    kind = sae_format(path)
    loaded = _load_sae_lens(path, device) if kind == "sae-lens" else _load_authors(path, device)
    check_finite(loaded.weights.tensors(), f"SAE {path}")
    return loaded


def _load_sae_lens(path: Path, device: str) -> LoadedSAE:
    from sae_lens import SAE

    try:
        sae = SAE.load_from_disk(path, device=device)
    except Exception as err:  # sae-lens raises many kinds for a damaged or foreign folder
        raise ValueError(f"cannot load the sae-lens SAE at {path}: {type(err).__name__}: {err}") from None
    hook = sae.cfg.metadata.hook_name
    return LoadedSAE(from_sae_lens(sae), path, "sae-lens", site_of_hook(hook) if hook else None)


def _load_authors(path: Path, device: str) -> LoadedSAE:
    try:
        config = json.loads((path / AUTHORS_CONFIG).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path / AUTHORS_CONFIG} is not JSON: {err}") from None
    missing = [key for key in ("point", "k") if key not in config]
    if missing:
        raise ValueError(f"{path} has {AUTHORS_CONFIG} and {AUTHORS_WEIGHTS} but no {missing} in its config: "
                         "not an SAE of the paper authors' format")
    if config.get("bilinear_encoder"):
        raise ValueError(f"{path}: SAEs with a bilinear encoder are not supported")
    for key, kind in (("k", int), ("encoder_bias", bool)):
        if key in config and not isinstance(config[key], kind):
            raise ValueError(f"{path}: config field {key} must be {kind.__name__}, got {config[key]!r}")
    state = load_file(str(path / AUTHORS_WEIGHTS), device=device)
    check_finite(state, f"SAE {path}")
    try:
        w_enc, w_dec, b_dec = state["w_enc.weight"], state["w_dec.weight"], state["b_dec"]
    except KeyError as err:
        raise ValueError(f"{path}/model.safetensors lacks {err}; it holds {sorted(state)}") from None
    d_sae, d = w_enc.shape
    if w_dec.shape != (d, d_sae) or b_dec.shape != (d,):
        raise ValueError(f"{path}: shapes w_enc {tuple(w_enc.shape)}, w_dec {tuple(w_dec.shape)}, "
                         f"b_dec {tuple(b_dec.shape)} do not fit one SAE")
    scale = config.get("normalize") or 1.0
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
        raise ValueError(f"{path}: config field normalize must be a positive number or null, got {scale!r}")
    bias = state.get("w_enc.bias", torch.zeros(d_sae, dtype=w_enc.dtype, device=w_enc.device))
    weights = SAEWeights(
        W_enc=(w_enc.T / scale).float(), b_enc=bias.float(), W_dec=(w_dec.T * scale).float(),
        b_dec=(b_dec * scale).float(), apply_b_dec_to_input=True, k=int(config["k"]), relu=False,
    )
    return LoadedSAE(weights, path, "authors", _authors_point(config["point"], path))


def _authors_point(point, path: Path) -> Point | None:
    """Their `point` is `[name, layer]` (a serialised namedtuple)."""
    if point is None:
        return None
    if not isinstance(point, (list, tuple)) or len(point) != 2 or not isinstance(point[1], int):
        raise ValueError(f"{path}: config field point must be [name, layer], got {point!r}")
    site = AUTHORS_POINTS.get(str(point[0]))
    if site is None:
        raise ValueError(f"{path}: point {point[0]!r} is not one this toolkit analyses "
                         f"({', '.join(sorted(AUTHORS_POINTS))})")
    return int(point[1]), site


def check_sae_point(sae: LoadedSAE, d_model: int, layer: int, sites: tuple[str, ...], role: str,
                    allow_hookless: bool = False) -> str:
    """Refuse an SAE used where it does not belong; returns the site it is used at.

    `sites` are the sites the role accepts (input: resid_mid or mlp_in; output: mlp_out).
    An SAE that records no hook is refused unless `allow_hookless`; it is then taken to read
    the first of `sites` at `layer`.
    """
    if sae.weights.d_in != d_model:
        raise ValueError(f"{role} SAE {sae.path} reads width {sae.weights.d_in} but the model's d_model is {d_model}")
    if sae.point is None:
        if not allow_hookless:
            raise ValueError(f"{role} SAE {sae.path} records no hook, so nothing says it reads layer {layer}'s "
                             f"{' or '.join(sites)}; pass --allow-hookless-saes to use it as such on purpose")
        return sites[0]
    sae_layer, site = sae.point
    if sae_layer != layer or site not in sites:
        wanted = " or ".join(hook_name(layer, s) for s in sites)
        raise ValueError(f"{role} SAE {sae.description} does not fit: layer {layer}'s {role} SAE must read {wanted}")
    return site


def write_sae_extras(folder: str | Path, train_config: dict, metrics: dict, log_sparsity: torch.Tensor) -> None:
    """Our files beside sae-lens's: the training recipe, the metrics and firing frequencies."""
    folder = Path(folder)
    (folder / TRAIN_CONFIG_FILE).write_text(json.dumps(train_config, indent=2))
    (folder / METRICS_FILE).write_text(json.dumps(metrics, indent=2))
    save_file({"sparsity": log_sparsity.contiguous().cpu()}, str(folder / SPARSITY_FILE))


def read_metrics(folder: str | Path) -> dict:
    return json.loads((Path(folder) / METRICS_FILE).read_text())

