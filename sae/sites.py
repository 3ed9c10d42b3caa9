"""Where activations are read: (layer, site) points and their TransformerLens hooks.

A site names one activation of a block:

- `resid_mid`: the residual stream between attention and MLP, before the MLP's norm
  (`blocks.{l}.hook_resid_mid`), the input side the input SAEs are trained on;
- `mlp_out`: the MLP's output (`blocks.{l}.hook_mlp_out`), where the output SAEs live;
- `mlp_in`: what the bilinear MLP really multiplies, `ln2.hook_normalized * ln2.w`.
  TransformerLens fires `hook_normalized` before the RMS norm's gain, so the hook alone is
  not the MLP input unless the gain was folded into `W_in`/`W_gate` (then `ln2` has no `w`
  and the hook value is used as is).
"""

from __future__ import annotations

from transformer_lens import HookedTransformer

SITES = ("resid_mid", "mlp_in", "mlp_out")

Point = tuple[int, str]  # (layer, site)


def hook_name(layer: int, site: str) -> str:
    """The TransformerLens hook that fires the activation of `site` (for `mlp_in`, before
    the norm's gain is applied)."""
    if site == "resid_mid":
        return f"blocks.{layer}.hook_resid_mid"
    if site == "mlp_out":
        return f"blocks.{layer}.hook_mlp_out"
    if site == "mlp_in":
        return f"blocks.{layer}.ln2.hook_normalized"
    raise ValueError(f"unknown site {site!r}; known sites are {', '.join(SITES)}")


def site_of_hook(name: str) -> Point | None:
    """The (layer, site) a TransformerLens hook name belongs to, or None for other hooks."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "blocks" or not parts[1].isdigit():
        return None
    tail = ".".join(parts[2:])
    site = {"hook_resid_mid": "resid_mid", "hook_mlp_out": "mlp_out", "ln2.hook_normalized": "mlp_in"}.get(tail)
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

