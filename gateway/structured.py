"""A request's output constraint, from whichever of OpenAI's and vLLM's
fields carries it: ``response_format`` (json_object, json_schema),
``structured_outputs`` (vLLM's newer field) or the ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` extras.

Everything is compiled (and so checked) here, before any worker is asked:
a bad schema, regex or grammar is a 400 whose ``param`` names the field.
"""

from __future__ import annotations

from typing import Any

from engine.structured_output import StructuredOutputsParams


class InvalidField(ValueError):
    """A 400 whose OpenAI error object names ``param``."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def constraint_of(body: Any) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, or None. InvalidField when it
    asks for more than one or the one is invalid."""
    found: list[tuple[str, dict[str, Any], str | None]] = []  # (param, spec, path)
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidField("structured_outputs", "structured_outputs must be an object")
        found.append(("structured_outputs", so, None))
    for name, kind in _GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, {kind: value}, name))
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            where = "response_format.json_schema.schema" if "json" in spec else "response_format"
            found.append(("response_format", spec, where))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _, _ in found)
        raise InvalidField(found[1][0], f"give one output constraint, not several ({names})")
    return build(*found[0])


def build(param: str, spec: dict[str, Any], where: str | None = None) -> StructuredOutputsParams:
    """StructuredOutputsParams(**spec); its ValueError as a 400 naming
    ``param``, its message starting with ``where`` (the field's full path)."""
    try:
        return StructuredOutputsParams(**spec)
    except TypeError as exc:  # an unknown key
        raise InvalidField(param, f"{param}: {exc}") from None
    except ValueError as exc:
        message = str(exc)
        own = f"structured_outputs.{next(iter(spec), '')}"
        if where is not None and message.startswith(own):
            message = where + message[len(own):]
        elif not message.startswith(param):
            message = f"{param}: {message}"
        raise InvalidField(param, message) from None


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if not isinstance(fmt, dict):
        raise InvalidField("response_format", "response_format must be an object")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict):
            raise InvalidField("response_format",
                               "response_format.json_schema must be an object")
        schema = inner.get("schema", inner.get("json_schema"))
        if not isinstance(schema, dict):
            raise InvalidField("response_format",
                               "response_format.json_schema.schema must be a JSON Schema object")
        return {"json": schema}
    raise InvalidField("response_format", f"response_format.type must be 'text', "
                                          f"'json_object' or 'json_schema', got {kind!r}")
