"""Convert a published bilinear LM checkpoint (the paper authors' format) into ours.

Their format: an HF-style `config.json` with `n_layer, n_head,
d_model, d_hidden, n_ctx, bias, normalization, tokenizer` and weights in `model.safetensors`
or `pytorch_model.bin`, named

    transformer.wte.weight            [vocab, d]            token embedding
    transformer.h.{i}.attn.qkv.weight [3d, d]               rows laid out (3, n_head, d_head)
    transformer.h.{i}.attn.o.weight   [d, d]                columns laid out (n_head, d_head)
    transformer.h.{i}.mlp.w.weight    [2 d_hidden, d]       first half W, second half V
    transformer.h.{i}.mlp.p.weight    [d, d_hidden]
    lm_head.weight                    [vocab, d]            untied, no bias

Norms carry no weights in the official code (`x / sqrt(mean(x^2) + 1e-8)`; gains `n1`, `n2`,
`n_f` of older checkpoints are taken when present), rotary covers the whole head with base
10000 in the rotate-half convention, and the official code multiplies each attention output
by `1 / sqrt(2 n_layer)` before it joins the residual stream. Their research code before
October 2024 did not: its configs say `scale_attn: false`, or nothing. A config without the
field is therefore ambiguous and refused unless the caller says which (`scale_attn`). The
converter folds the scale into `W_O`, so the result is a plain TransformerLens model that
`load_model` reads. Half-precision (bf16, fp16) checkpoints are converted to float32.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from pipelines.engine.files import atomic_dir
from pipelines.engine.paths import MODEL_CONFIG, TOKENIZER, ModelPaths
from pipelines.lm.model import ModelConfig, build_model, save_model

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"

# Their norms have no gain and this fixed epsilon.
PUBLISHED_EPS = 1e-8
ROTARY_BASE = 10000
# Buffers a checkpoint may carry that hold no learned weight (checked, then dropped).
ROTARY_BUFFER = "rotary.inv_freq"
# Where the checkpoint config may state the vocabulary size (we trust the embedding).
VOCAB_FIELDS = ("vocab_size", "d_vocab", "n_vocab")


def convert_checkpoint(
    src_dir: str | Path, out_dir: str | Path, tokenizer: str | Path | None = None, force: bool = False,
    scale_attn: str = "config",
) -> ModelConfig:
    """Convert the published checkpoint in `src_dir` into our format in `out_dir`.

    `tokenizer` is the path to a `tokenizers` `tokenizer.json` (or a directory holding
    one), used only when `src_dir` has no `tokenizer.json` of its own. `scale_attn` is
    "config" (the checkpoint's `scale_attn` field decides), "on" or "off". Everything is
    read and checked before anything is written, so a refused checkpoint leaves no output;
    a folder that already holds a model is replaced only with `force`. Returns the config
    of the converted model.
    """
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    if not src_dir.is_dir():
        raise FileNotFoundError(f"no published checkpoint at {src_dir}: not a directory")
    if out_dir.exists() and out_dir.resolve() == src_dir.resolve():
        raise ValueError("out_dir must differ from src_dir: converting in place would "
                         f"overwrite the published {MODEL_CONFIG}")
    if ModelPaths(out_dir).weights.exists() and not force:
        raise ValueError(f"{out_dir} already holds a model; pass --force to replace it (stages that used it, "
                         "such as SAEs trained on it, would then no longer match it)")
    published = read_published_config(src_dir)
    scaled = attention_scaled(published, scale_attn)
    state = read_published_weights(src_dir)
    tokenizer_file = find_tokenizer(src_dir, tokenizer, published)
    cfg, params = map_weights(published, state, scaled)
    check_tokenizer_fits(tokenizer_file, cfg.d_vocab)

    model = build_model(cfg)
    mismatch = {name for name, _ in model.named_parameters()} ^ set(params)
    if mismatch:  # a mapping bug, not a user error: every parameter must be set explicitly
        raise RuntimeError(f"converter does not match the model's parameters: {sorted(mismatch)}")
    model.load_state_dict(params, strict=False)  # buffers (rotary, mask) keep their values
    with atomic_dir(out_dir) as tmp:
        save_model(model, cfg, tmp)
        shutil.copyfile(tokenizer_file, tmp / TOKENIZER)
    return cfg


def attention_scaled(config: dict, choice: str) -> bool:
    """Whether the checkpoint's attention output is scaled by 1/sqrt(2 n_layer)."""
    if choice in ("on", "off"):
        return choice == "on"
    if "scale_attn" not in config:
        raise ValueError(
            "the checkpoint's config has no scale_attn field, and that is ambiguous: the official code "
            "scales each attention output by 1/sqrt(2 n_layer), the research code before October 2024 did not. "
            "Converting with the wrong choice gives a model whose logits are off; say which with "
            "--attention-scale on (official) or off (early research checkpoints)")
    return config["scale_attn"]


# --------------------------------------------------------------------------- reading


def read_published_config(src_dir: Path) -> dict:
    """The published `config.json`, refused unless it describes a model we can hold."""
    path = src_dir / MODEL_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"no published checkpoint at {src_dir}: {MODEL_CONFIG} is missing")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"corrupt checkpoint config {path}: {err}") from err
    required = ("n_layer", "n_head", "d_model", "d_hidden", "n_ctx")
    absent = [key for key in required if key not in config]
    if absent:
        raise ValueError(f"{path} is not a published bilinear config: missing {absent} "
                         f"(found {sorted(config)})")
    check_types(config, path)
    refuse_unsupported(config)
    return config


CONFIG_TYPES = {"n_layer": int, "n_head": int, "d_model": int, "d_hidden": int, "n_ctx": int, "bias": bool,
                "normalization": (bool, str), "bilinear": bool, "scale_attn": bool, "norm_bias": bool,
                "attention2": bool}


def check_types(config: dict, path: Path) -> None:
    """Refuse config values of the wrong type: a string "false" is not a boolean."""
    for key, kind in CONFIG_TYPES.items():
        if key not in config:
            continue
        value = config[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = any(isinstance(value, k) and not (k is int and isinstance(value, bool)) for k in kinds)
        if not ok:
            wanted = " or ".join("a boolean" if k is bool else "an integer" if k is int else "a string" for k in kinds)
            raise ValueError(f"{path}: config field {key} must be {wanted}, got {value!r}")


def refuse_unsupported(config: dict) -> None:
    """Raise ValueError for variants that a TransformerLens bilinear model cannot express."""
    if config.get("bias", False):
        raise ValueError(
            "cannot convert a checkpoint with bias=True: its bilinear MLP has a bias inside "
            "each factor, (W x + b1) * (V x + b2), and TransformerLens's gated MLP only adds "
            "a bias after the product, so the converted model would compute something else"
        )
    if config.get("normalization", True) in (False, "none"):
        raise ValueError("cannot convert a checkpoint with normalization=False: our model "
                         "always applies RMS norm")
    if config.get("normalization", True) not in (True, "rms"):
        raise ValueError(f"cannot convert normalization={config['normalization']!r}: only RMS norm is supported")
    if config.get("norm_bias"):
        raise ValueError("cannot convert a checkpoint with norm_bias=True: our RMS norms have no bias")
    if config.get("attention2"):
        raise ValueError("cannot convert a checkpoint with attention2=True: a second attention variant")
    if not config.get("bilinear", True) or config.get("gate") is not None:
        raise ValueError(
            f"cannot convert a non-bilinear MLP (bilinear={config.get('bilinear')}, "
            f"gate={config.get('gate')!r}): this project studies bilinear MLPs only"
        )


def read_published_weights(src_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint by name, from safetensors (single or sharded) or torch."""
    if (src_dir / SAFETENSORS_FILE).is_file():
        return load_file(str(src_dir / SAFETENSORS_FILE), device="cpu")
    if (src_dir / SAFETENSORS_INDEX).is_file():
        shards = set(json.loads((src_dir / SAFETENSORS_INDEX).read_text())["weight_map"].values())
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(shards):
            state.update(load_file(str(src_dir / shard), device="cpu"))
        return state
    if (src_dir / TORCH_FILE).is_file():
        # weights_only: a checkpoint from the internet must not run code on load.
        return torch.load(src_dir / TORCH_FILE, map_location="cpu", weights_only=True)
    raise FileNotFoundError(
        f"no published checkpoint at {src_dir}: expected weights in {SAFETENSORS_FILE} or "
        f"{TORCH_FILE}, found {sorted(p.name for p in src_dir.iterdir())}"
    )


def find_tokenizer(src_dir: Path, tokenizer: str | Path | None, config: dict) -> Path:
    """The tokenizer.json to ship with the model: the checkpoint's own, else `tokenizer`."""
    if (src_dir / TOKENIZER).is_file():
        return src_dir / TOKENIZER
    if tokenizer is not None:
        path = Path(tokenizer)
        if path.is_dir():
            path = path / TOKENIZER
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} does not exist")
        return path
    raise FileNotFoundError(
        f"{src_dir} has no {TOKENIZER} and no tokenizer was given. The checkpoint's "
        f"config names the hub tokenizer {config.get('tokenizer')!r}, which cannot be "
        f"downloaded here (no network): fetch that tokenizer's {TOKENIZER} elsewhere "
        f"and pass its path as `tokenizer`, or place it in {src_dir}"
    )


def check_tokenizer_fits(path: Path, d_vocab: int) -> None:
    """Refuse a tokenizer that is unreadable or emits ids past the embedding."""
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as err:  # tokenizers raises a bare Exception for a bad file
        raise ValueError(f"{path} is not a readable tokenizers file: {err}") from err
    if size > d_vocab:
        raise ValueError(f"tokenizer {path} has {size} tokens but the model embeds only "
                         f"{d_vocab}: it is not this model's tokenizer")


# --------------------------------------------------------------------------- mapping


class KeyFinder:
    """Looks up checkpoint tensors by name suffix and remembers which ones were used.

    Matching on the suffix (`h.0.attn.qkv.weight` matches `transformer.h.0.attn.qkv.weight`
    or `model.transformer.h.0...`) tolerates an extra wrapper prefix; anything not found
    is reported with the keys that do exist, so a differently named checkpoint is obvious.
    """

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state
        self.used: set[str] = set()

    def get(self, suffix: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The unique tensor whose name is `suffix` or ends in `.suffix`, of shape `shape`."""
        hits = [k for k in self.state if k == suffix or k.endswith("." + suffix)]
        if len(hits) != 1:
            problem = "no key" if not hits else f"several keys {hits}"
            raise ValueError(f"checkpoint has {problem} ending in {suffix!r}; "
                           f"keys found: {describe_keys(self.state)}")
        key = hits[0]
        tensor = self.state[key]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"checkpoint tensor {key} has shape {tuple(tensor.shape)}, "
                             f"expected {shape} from the config")
        self.used.add(key)
        return tensor.to(torch.float64)  # fold scales in float64, cast once at the end

    def optional(self, suffix: str, shape: tuple[int, ...], default: torch.Tensor) -> torch.Tensor:
        """The tensor ending in `suffix` if the checkpoint has one (older norms have gains), else `default`."""
        if any(k == suffix or k.endswith("." + suffix) for k in self.state):
            return self.get(suffix, shape)
        return default.to(torch.float64)

    def check_all_used(self, d_head: int) -> None:
        """Refuse leftover tensors (they would be silently lost), except rotary buffers."""
        leftover = sorted(set(self.state) - self.used)
        for key in [k for k in leftover if k.endswith(ROTARY_BUFFER)]:
            check_rotary_buffer(key, self.state[key], d_head)
            leftover.remove(key)
        if leftover:
            raise ValueError(f"checkpoint has weights the converter does not understand and "
                             f"would drop: {leftover[:20]}")


def describe_keys(state: dict[str, torch.Tensor], limit: int = 40) -> str:
    keys = sorted(state)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def check_rotary_buffer(key: str, inv_freq: torch.Tensor, d_head: int) -> None:
    """A stored `inv_freq` must be base 10000 over the full head, which our model assumes,
    up to the rounding of the dtype it is stored in (bf16 keeps 8 bits of mantissa)."""
    expected = 1.0 / ROTARY_BASE ** (torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
    rtol = max(1e-4, 2 * torch.finfo(inv_freq.dtype).eps) if inv_freq.is_floating_point() else 1e-4
    if inv_freq.shape != expected.shape or not torch.allclose(
        inv_freq.double(), expected, rtol=rtol
    ):
        raise ValueError(f"{key} is not rotary base {ROTARY_BASE} over the full head "
                         f"dimension {d_head}; the converted model would misplace positions")


def map_weights(
    config: dict, state: dict[str, torch.Tensor], scale_attn: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Our config and every HookedTransformer parameter (float32) from the published ones."""
    n_layers, n_heads, d_model = config["n_layer"], config["n_head"], config["d_model"]
    if d_model % n_heads:
        raise ValueError(f"d_model {d_model} is not divisible by n_head {n_heads}")
    keys = KeyFinder(state)
    d_vocab = infer_vocab(config, state)
    cfg = ModelConfig(n_layers=n_layers, d_model=d_model, n_heads=n_heads,
                      d_mlp=config["d_hidden"], n_ctx=config["n_ctx"], d_vocab=d_vocab,
                      eps=PUBLISHED_EPS)

    params = {
        "embed.W_E": keys.get("wte.weight", (d_vocab, d_model)),
        # nn.Linear computes x @ weight.T, TransformerLens x @ W_U.
        "unembed.W_U": keys.get("lm_head.weight", (d_vocab, d_model)).T,
        "unembed.b_U": torch.zeros(d_vocab),
        "ln_final.w": keys.optional("n_f.weight", (d_model,), torch.ones(d_model)),
    }
    attn_scale = 1.0 / math.sqrt(2 * n_layers) if scale_attn else 1.0
    for layer in range(n_layers):
        prefix = f"h.{layer}."
        params.update(attention_params(keys, prefix, layer, cfg, attn_scale))
        params.update(mlp_params(keys, prefix, layer, cfg))
    keys.check_all_used(cfg.d_head)
    return cfg, {name: t.to(torch.float32).contiguous() for name, t in params.items()}


def infer_vocab(config: dict, state: dict[str, torch.Tensor]) -> int:
    """The vocabulary size, from the embedding's rows; a config field must agree with it."""
    hits = [k for k in state if k == "wte.weight" or k.endswith(".wte.weight")]
    if len(hits) != 1:
        raise ValueError(f"checkpoint has no unique embedding 'transformer.wte.weight'; "
                       f"keys found: {describe_keys(state)}")
    d_vocab = state[hits[0]].shape[0]
    for field in VOCAB_FIELDS:
        if field in config and config[field] != d_vocab:
            raise ValueError(f"config says {field}={config[field]} but the embedding "
                             f"{hits[0]} has {d_vocab} rows")
    return d_vocab


def attention_params(
    keys: KeyFinder, prefix: str, layer: int, cfg: ModelConfig, scale: float
) -> dict[str, torch.Tensor]:
    """W_Q/W_K/W_V [n_heads, d_model, d_head] and W_O [n_heads, d_head, d_model] of a layer.

    `qkv.weight` is [3 d_model, d_model] with rows (3, n_head, d_head); `o.weight` is
    [d_model, d_model] whose columns are the concatenated heads (n_head, d_head).
    `scale` (1/sqrt(2 n_layer)) multiplies their attention output, so it goes into W_O.
    """
    d, h, dh = cfg.d_model, cfg.n_heads, cfg.d_head
    qkv = keys.get(prefix + "attn.qkv.weight", (3 * d, d)).reshape(3, h, dh, d)
    w_q, w_k, w_v = qkv.transpose(-1, -2)  # each [h, d, dh]
    w_o = keys.get(prefix + "attn.o.weight", (d, d)).T.reshape(h, dh, d) * scale
    out = f"blocks.{layer}."
    return {
        out + "ln1.w": keys.optional(prefix + "n1.weight", (d,), torch.ones(d)),
        out + "attn.W_Q": w_q, out + "attn.W_K": w_k, out + "attn.W_V": w_v,
        out + "attn.W_O": w_o,
        out + "attn.b_Q": torch.zeros(h, dh), out + "attn.b_K": torch.zeros(h, dh),
        out + "attn.b_V": torch.zeros(h, dh), out + "attn.b_O": torch.zeros(d),
    }


def mlp_params(
    keys: KeyFinder, prefix: str, layer: int, cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """W_gate, W_in [d_model, d_mlp] and W_out [d_mlp, d_model] of a layer's bilinear MLP.

    `mlp.w.weight` is [2 d_hidden, d_model]: rows of W then rows of V, and the MLP is
    p((W x) * (V x)). W is the factor their code passes through the (here absent) gate, so
    it becomes W_gate; with an identity activation the product is symmetric anyway.
    """
    d, m = cfg.d_model, cfg.d_mlp
    w, v = keys.get(prefix + "mlp.w.weight", (2 * m, d)).split(m, dim=0)
    p = keys.get(prefix + "mlp.p.weight", (d, m))
    out = f"blocks.{layer}."
    return {
        out + "ln2.w": keys.optional(prefix + "n2.weight", (d,), torch.ones(d)),
        out + "mlp.W_gate": w.T, out + "mlp.W_in": v.T, out + "mlp.W_out": p.T,
        out + "mlp.b_in": torch.zeros(m), out + "mlp.b_out": torch.zeros(d),
    }
