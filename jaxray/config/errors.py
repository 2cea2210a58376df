"""Config errors in words: the ConfigError messages of ``validate`` and ``invalid``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """A config that cannot run; the message names the field and what is allowed."""


def _allowed_keys(cls: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the model that sits at ``loc`` below ``cls`` (for "unknown key" errors)."""
    for part in loc:
        if isinstance(part, int):
            continue
        annotation = cls.model_fields[part].annotation
        inner = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)]
        models = [a for a in inner if issubclass(a, BaseModel)]
        if not models:
            return []
        cls = models[0]
    return list(cls.model_fields)


def _where(prefix: str, loc: tuple = ()) -> str:
    return (prefix + ".".join(str(p) for p in loc)).rstrip(".") or "(top level)"


def shown(value: Any) -> str:
    """``value`` as config messages quote it: YAML spelling for booleans and null, strings quoted,
    else Python's repr; at most 80 characters."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _format(err: ValidationError, source: str, root: type[BaseModel], prefix: str = "") -> str:
    """Each pydantic error on a line of its own, ending with the value received ("..., got 0")."""
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        msg = "Input should be true or false" if e["type"] == "bool_type" else e["msg"]
        msg = msg.removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown key; allowed: {', '.join(_allowed_keys(root, e['loc'][:-1]))}"
        elif e["type"] != "missing" and not (e["type"] == "value_error" and isinstance(e["input"], dict)):
            msg = f"{msg}, got {shown(e['input'])}"  # not for a whole section's check
        lines.append(f"  {_where(prefix, e['loc'])}: {msg}")
    return "\n".join(lines)


def invalid(source: str, message: str, prefix: str = "") -> ConfigError:
    """A post-parse check's ConfigError, worded as ``validate``'s: "invalid config SOURCE:", the field
    path and ``message``."""
    return ConfigError(f"invalid config {source}:\n  {_where(prefix)}: {message}")


def validate(cls: type[BaseModel], data: Any, source: str, prefix: str = ""):
    """``cls.model_validate(data)``; ConfigError naming ``source``, each field's path after
    ``prefix``, what is allowed and the value received."""
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format(err, source, cls, prefix)) from None
    except ConfigError as err:
        raise ConfigError(f"invalid config {source}: {prefix}{err}") from None
