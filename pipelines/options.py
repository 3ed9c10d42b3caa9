"""Command-line options made from config dataclasses, so each default and its help exist once.

`add_config(parser, Cls)` adds `--field-name` for every field of `Cls` (or the ones named),
typed from the annotation, with the field's documentation and default as help. The parsed
value stays None unless given, so `config_from(args, Cls, base)` applies only what the user
typed on top of `base` (the dataclass defaults, a preset, or a saved config).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from circuits.config import Config


def flag(name: str, rename: dict[str, str] | None = None) -> str:
    return "--" + (rename or {}).get(name, name).replace("_", "-")


def add_config(parser: argparse.ArgumentParser, cls: type[Config], only: tuple[str, ...] | None = None,
               skip: tuple[str, ...] = (), rename: dict[str, str] | None = None,
               default_text: str | None = None) -> None:
    """Add one option per field of `cls`; `default_text` replaces the shown defaults (for
    fields whose default comes from elsewhere, such as a preset)."""
    hints = typing.get_type_hints(cls)
    base = cls()
    group = parser.add_argument_group(cls.__doc__.splitlines()[0].rstrip(".").lower() if cls.__doc__ else cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        kind = _scalar(hints[f.name])
        default = getattr(base, f.name)
        doc = f.metadata.get("doc", "")
        if default_text is not None:
            help_text = f"{doc} (default: {default_text})"
        elif default is None and "default" in doc:
            help_text = doc  # the documentation says what None means
        else:
            help_text = f"{doc} (default: {'none' if default is None else default})"
        help_text = help_text.replace("%", "%%")
        name = flag(f.name, rename)
        dest = f"{cls.__name__}.{f.name}"
        if kind is bool:
            group.add_argument(name, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            choices = f.metadata.get("choices")
            group.add_argument(name, dest=dest, type=_parser(kind, name), default=None, help=help_text,
                               choices=choices, metavar=None if choices else kind.__name__.upper())


def config_from(args: argparse.Namespace, cls: type[Config], base: Config | None = None) -> Config:
    """`base` (default: the dataclass defaults) with every option of `cls` the user gave."""
    base = base or cls()
    given = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f"{cls.__name__}.{f.name}", None)
        if value is not None:
            given[f.name] = value
    return base.replace(**given) if given else base


def _scalar(kind):
    """int from `int | None`, and so on."""
    if typing.get_origin(kind) in (typing.Union, getattr(__import__("types"), "UnionType")):
        options = [k for k in typing.get_args(kind) if k is not type(None)]
        return options[0]
    return kind


def _parser(kind, name: str):
    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes {kind.__name__} values, not {text!r}") from None

    parse.__name__ = kind.__name__
    return parse
