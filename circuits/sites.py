"""Sites: where a layer's activations are read, what each implies, and their hooks.

A site names one activation of a block:

- `resid_mid`: the residual stream between attention and MLP, before the MLP's norm
  (`blocks.{l}.hook_resid_mid`), the default input side. An SAE there writes `r`; the MLP
  multiplies `x = g * r / rms(r)`, so its input basis carries the norm's gain `g` and its
  quadratic forms a per-token factor `1/rms(r)^2` (`circuits.sae_basis`).
- `mlp_in`: what the bilinear MLP really multiplies, `ln2.hook_normalized * ln2.w` (where the
  paper authors put their input SAEs): no gain in the basis, no per-token factor.
  TransformerLens fires `hook_normalized` before the RMS norm's gain, so the hook alone is
  not the MLP input unless the gain was folded into `W_in`/`W_gate` (then `ln2` has no `w`
  and the hook value is used as is).
- `mlp_out`: the MLP's output (`blocks.{l}.hook_mlp_out`), the one output site, where the
  output SAEs live.

Every other module names sites through the constants here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer

RESID_MID = "resid_mid"
MLP_IN = "mlp_in"
MLP_OUT = "mlp_out"
SITES = (RESID_MID, MLP_IN, MLP_OUT)  # the order tables and pages list sites in
INPUT_SITES = (RESID_MID, MLP_IN)  # the first is the default input side
OUTPUT_SITE = MLP_OUT
DEFAULT_INPUT_SITE = INPUT_SITES[0]
DEFAULT_SAE_SITES = (DEFAULT_INPUT_SITE, OUTPUT_SITE)  # the SAE pair a run trains by default

HOOKS = {RESID_MID: "hook_resid_mid", MLP_IN: "ln2.hook_normalized", MLP_OUT: "hook_mlp_out"}

Point = tuple[int, str]  # (layer, site)
Gain = TypeVar("Gain")


def check_input_site(site: str) -> str:
    """`site`, or ValueError when it is not an input site."""
    if site not in INPUT_SITES:
        raise ValueError(f"unknown input site {site!r}; choose from {', '.join(INPUT_SITES)}")
    return site


def input_gain(site: str, g: Gain) -> Gain | None:
    """The gain an input SAE's basis on `site` carries: the norm's `g` on resid_mid (the norm
    comes after the SAE), None on mlp_in (the SAE reads the MLP input itself)."""
    return g if check_input_site(site) == RESID_MID else None


def hook_name(layer: int, site: str) -> str:
    """The TransformerLens hook that fires the activation of `site` (for `mlp_in`, before
    the norm's gain is applied)."""
    if site not in HOOKS:
        raise ValueError(f"unknown site {site!r}; known sites are {', '.join(SITES)}")
    return f"blocks.{layer}.{HOOKS[site]}"


def site_of_hook(name: str) -> Point | None:
    """The (layer, site) a TransformerLens hook name belongs to, or None for other hooks."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "blocks" or not parts[1].isdigit():
        return None
    tail = ".".join(parts[2:])
    site = next((s for s, hook in HOOKS.items() if hook == tail), None)
    return None if site is None else (int(parts[1]), site)


def point_name(point: Point) -> str:
    """Folder and file name of a point, e.g. `layer3_mlp_out`."""
    layer, site = point
    return f"layer{layer}_{site}"


def check_points(model: HookedTransformer, points: list[Point], sites: tuple[str, ...] = SITES) -> None:
    """Raise ValueError for a point whose site is not in `sites` or whose hook the model lacks."""
    if not points:
        raise ValueError("no (layer, site) points were given")
    for layer, site in points:
        if site not in sites:
            raise ValueError(f"unknown site {site!r}; choose from {', '.join(sites)}")
        if not 0 <= layer < model.cfg.n_layers:
            raise ValueError(f"layer {layer} does not exist: the model has layers 0..{model.cfg.n_layers - 1}")
        check_hook(model, hook_name(layer, site))


def check_hook(model: HookedTransformer, name: str) -> None:
    """Raise ValueError naming similar hooks when `name` is not a hook of `model`."""
    if name not in model.hook_dict:
        tail = name.rsplit(".", 1)[-1]
        similar = [h for h in model.hook_dict if h.endswith(tail)][:4]
        raise ValueError(f"unknown hook {name!r}; hooks with that ending: {similar or 'none'}")
