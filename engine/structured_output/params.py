"""What a request's output must match: vLLM's ``StructuredOutputsParams``.

Torch-free: the gateway builds and checks these too, so a bad schema or
regex is a 400 before any compute. Each spec is turned into one grammar in
llguidance's format (``grammar``), checked when the object is built (compiled
against a vocabulary of single bytes: errors, and grammars no text matches);
the runner compiles that grammar against its tokenizer (engine/structured_output/
matchers.py). The spec, not the compiled grammar, is what crosses the wire.
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from functools import cache
from typing import Any

# NOTE: compact JSON (no free whitespace between tokens): a small model
# given the freedom tends to fill max_tokens with newlines and spaces.
_JSON_OPTIONS = {"whitespace_flexible": False}
# Characters a Rust regex (llguidance's dialect) needs escaped to match themselves.
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Deeper schemas are refused: llguidance reads them recursively (thousands of
# levels crash the process), and no real schema comes near this.
MAX_SCHEMA_DEPTH = 64


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: ``json`` (a JSON Schema, as a dict or a JSON
    string), ``regex``, ``choice`` (one of these strings), ``grammar`` (Lark,
    or GBNF as llama.cpp writes it) or ``json_object=True`` (any JSON object).

    ValueError at construction, naming the field, when the spec is invalid
    or uses what the grammar engine does not support.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            # A string or a mapping is iterable too, but not a list of choices.
            if isinstance(self.choice, str | bytes | dict) or not hasattr(self.choice, "__iter__"):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 f"non-empty strings, got {self.choice!r:.80}")
            self.choice = list(self.choice)
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, "
                             f"grammar, json_object; got {given or 'none'}")
        # NOTE: a plain attribute, not a field: asdict() (the gateway's request
        # record) and comparisons see the spec only.
        self._compiled = _to_grammar(given[0], getattr(self, given[0]))

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def llg_grammar(self) -> str:
        """The constraint as one llguidance grammar (validated)."""
        return self._compiled

    @property
    def key(self) -> str:
        """Equal for equal specs: what compiled grammars are cached by."""
        return self._compiled

    def to_wire(self) -> tuple[str, str]:
        """(kind, value as text): what travels in the protobuf."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            value = jsonlib.dumps(value)
        elif kind == "choice":
            value = jsonlib.dumps(value)
        elif kind == "json_object":
            value = ""
        return kind, value

    @classmethod
    def from_wire(cls, kind: str, value: str) -> StructuredOutputsParams:
        if kind not in _KINDS:
            raise ValueError(f"structured_outputs: unknown kind {kind!r}")
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "choice":
            try:
                choice = jsonlib.loads(value)
            except ValueError:
                raise ValueError("structured_outputs.choice must be a JSON list of "
                                 "strings") from None
            except RecursionError:
                raise ValueError("structured_outputs.choice is nested too deep") from None
            return cls(choice=choice)
        return cls(**{kind: value})


def _to_grammar(kind: str, value: Any) -> str:
    import llguidance

    matcher = llguidance.LLMatcher
    where = f"structured_outputs.{kind}"
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else _schema(value, where)
        try:
            grammar = matcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where} must be a non-empty string")
        grammar = matcher.grammar_from_regex(value)
    elif kind == "choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"{where} must be a non-empty list of non-empty strings")
        grammar = matcher.grammar_from_regex("|".join(_escape(c) for c in value))
    else:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{where} must be a non-empty string")
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            grammar = matcher.grammar_from_lark(any_to_lark(value))
        except Exception as exc:  # its GBNF converter raises its own error types
            raise ValueError(f"{where}: {exc}") from None
    _check(grammar, where)
    return grammar


def _check(grammar: str, where: str) -> None:
    """ValueError for a grammar that does not compile, or that no text
    matches (a schema that is only a reference to itself): compiled against
    a vocabulary of the 256 bytes, whose first mask then allows nothing. The
    model's vocabulary is not needed for either, and is not at hand in the
    gateway."""
    import llguidance

    matcher = llguidance.LLMatcher(_byte_vocabulary(), grammar, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
        if matcher.is_error():
            raise ValueError(f"{where}: no text matches it")
    if matcher.is_error():
        raise ValueError(f"{where}: {matcher.get_error().strip()}")


class _Bytes:
    """A vocabulary of one token per byte, and an end-of-sequence token
    (what llguidance's TokenizerWrapper reads)."""

    eos_token_id = 256
    bos_token_id = None
    special_token_ids = [256]
    tokens = [bytes([b]) for b in range(256)] + [b"</s>"]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@cache
def _byte_vocabulary():
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def _schema(value: Any, where: str) -> dict[str, Any]:
    too_deep = f"{where} is nested more than {MAX_SCHEMA_DEPTH} levels deep"
    if isinstance(value, str):
        try:
            value = jsonlib.loads(value)
        except ValueError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from None
        except RecursionError:  # deeper than Python's own reader goes
            raise ValueError(too_deep) from None
    if _depth_over(value, MAX_SCHEMA_DEPTH):
        raise ValueError(too_deep)
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON Schema object")
    return _closed(value)


def _closed(schema: Any, close: bool = True) -> Any:
    """``schema`` (a copy) with every object that lists its properties
    closed to others unless it says otherwise: JSON Schema allows extra keys
    by default, but a model held to a schema should write the listed ones
    (vLLM's default backend, xgrammar, does the same; so does OpenAI's strict
    mode). An object with no ``properties`` stays open, and so do the parts
    of an ``allOf`` (``close``): each lists only some of the properties."""
    if isinstance(schema, list):
        return [_closed(v, close) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema
            out[key] = {name: _closed(sub) for name, sub in value.items()}
        elif key in _VALUES:  # data, not schemas
            out[key] = value
        else:
            out[key] = _closed(value, key != "allOf")
    if close and isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


# Schema keywords whose value maps names to schemas, and those that hold data.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUES = ("enum", "const", "default", "examples")


def _depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests objects and arrays more than ``limit`` deep
    (walked without recursion, so any depth is safe to ask about)."""
    level, depth = [value], 0
    while level := [v for v in level if isinstance(v, dict | list)]:
        depth += 1
        if depth > limit:
            return True
        level = [child for v in level for child in (v.values() if isinstance(v, dict) else v)]
    return False


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)
