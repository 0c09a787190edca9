"""Configuration errors, the checks shared by the text and vision configurations and the one-line renderings of
values their messages use (docs/architecture.md §1.3)."""

from __future__ import annotations

import functools
import itertools
import json
import math
import types
from collections.abc import Iterable
from dataclasses import fields
from typing import Any, Union, get_args, get_origin, get_type_hints


class ConfigError(ValueError):
    """A configuration (a `config.json` or constructor arguments) is malformed or breaks a rule.

    `field` is the attribute (or, for the multimodal top level, the `config.json` key) at fault and `problem`
    the message without its name, so that `K3Config.from_dict` can name the key as it is written in the file.
    """

    def __init__(self, message: str, field: str | None = None, problem: str | None = None) -> None:
        super().__init__(message)
        self.field, self.problem = field, problem


def summarize(items: Iterable[Any], total: int | None = None, *, limit: int = 5, sep: str = ", ") -> str:
    """`items` joined by `sep`, cut after the first `limit`: 'a, b, c, d, e and 12,799,995 more'.

    Every list in an error message of the config and checkpoint layers goes through this, so that neither the
    message nor the time to build it grows with an absurd input. `total` is the full count when `items` is an
    iterator (only its first `limit` items are taken).
    """
    if total is None:
        items = items if hasattr(items, "__len__") else list(items)
        total = len(items)  # type: ignore[arg-type]
    shown = [str(item) for item in itertools.islice(items, limit)]
    rest = total - len(shown)
    return sep.join(shown) + (f" and {rest:,} more" if rest > 0 else "")


def show_value(value: Any, width: int = 80) -> str:
    """A config value for an error message: JSON spelling (strings quoted), long lists summarised, cut at `width`."""
    if isinstance(value, str):
        text = repr(value)
    elif isinstance(value, (list, tuple)):
        text = f"[{summarize((show_value(v, width) for v in value), len(value))}]"
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _type_problem(value: Any, hint: Any) -> str | None:
    """None if `value` is a JSON value of the field annotation `hint`, else what it must be ('an integer')."""
    if get_origin(hint) in (Union, types.UnionType):  # only `X | None` is used
        if value is None:
            return None
        (inner,) = [arg for arg in get_args(hint) if arg is not type(None)]
        problem = _type_problem(value, inner)
        return None if problem is None else f"{problem} or null"
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if is_int else "an integer"
    if hint is float:
        if not (is_int or isinstance(value, float)):
            return "a number"
        return None if is_int or math.isfinite(value) else "a finite number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    if get_origin(hint) is list:
        ok = isinstance(value, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
        return None if ok else "a list of integers"
    if get_origin(hint) is dict:
        return None if isinstance(value, dict) else "an object"
    raise TypeError(f"no JSON type rule for the annotation {hint!r}")


def check_field_types(obj: Any, key_prefix: str = "") -> None:
    """Raise `ConfigError` for the first dataclass field of `obj` whose value is not of its annotated JSON type
    (`key_prefix` + the field name is the error's `field`)."""
    owner = type(obj).__name__
    for name, hint in _field_hints(type(obj)).items():
        value = getattr(obj, name)
        problem = _type_problem(value, hint)
        if problem is not None:
            problem = f"must be {problem}, got {show_value(value)}"
            raise ConfigError(f"{owner}.{name} {problem}", key_prefix + name, problem)


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}
