"""Twenty fixed JSON Schemas for structured-output tests: nested objects,
arrays, enums, bounded numbers, required and optional fields, anyOf, $ref.

Every string and array is bounded and no object takes keys it does not
list (``strict``, as OpenAI's strict mode requires), so a greedy model that
likes to ramble still ends inside max_tokens.
"""

from __future__ import annotations

S = {"type": "string", "maxLength": 16}  # a short string



def strict(schema):
    """``schema`` with ``additionalProperties: false`` on every object."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if out.get("type") == "object":
        out.setdefault("additionalProperties", False)
    return out


_SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {"name": S, "age": {
        "type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}),
    ("a person with an address", {"type": "object", "properties": {
        "name": S, "address": {"type": "object", "properties": {"city": S, "zip": S},
                               "required": ["city", "zip"]}}, "required": ["name", "address"]}),
    ("three colors", {"type": "array", "items": S, "minItems": 1, "maxItems": 3}),
    ("a traffic light color", {"type": "string", "enum": ["red", "yellow", "green"]}),
    ("a dice roll", {"type": "object", "properties": {"roll": {
        "type": "integer", "minimum": 1, "maximum": 6}}, "required": ["roll"]}),
    ("a temperature", {"type": "object", "properties": {"celsius": {
        "type": "number", "minimum": -50, "maximum": 60}}, "required": ["celsius"]}),
    ("whether it rains", {"type": "object", "properties": {"raining": {"type": "boolean"}},
                          "required": ["raining"]}),
    ("a book, year optional", {"type": "object", "properties": {
        "title": S, "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
        "required": ["title"], "additionalProperties": False}),
    ("an id", {"type": "object", "properties": {"id": {"anyOf": [
        S, {"type": "integer", "minimum": 0, "maximum": 99999}]}}, "required": ["id"]}),
    ("two products", {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "object", "properties": {"name": S, "price": {
            "type": "number", "minimum": 0, "maximum": 1000}},
        "required": ["name", "price"], "additionalProperties": False}}),
    ("a 2x2 grid", {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "integer", "minimum": 0, "maximum": 9}}}),
    ("a version record", {"type": "object", "properties": {"version": {"const": 2},
                                                            "name": S},
                          "required": ["version", "name"]}),
    ("an airport code", {"type": "object", "properties": {"code": {
        "type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["code"]}),
    ("a nickname", {"type": "object", "properties": {"nick": {
        "type": "string", "minLength": 2, "maxLength": 8}}, "required": ["nick"]}),
    ("a middle name or none", {"type": "object", "properties": {"middle": {
        "anyOf": [S, {"type": "null"}]}}, "required": ["middle"]}),
    ("a point", {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -100, "maximum": 100},
        "y": {"type": "integer", "minimum": -100, "maximum": 100}},
        "required": ["x", "y"], "additionalProperties": False}),
    ("a priority", {"type": "object", "properties": {"level": {"enum": [1, 2, 3]},
                                                     "label": {"enum": ["low", "high"]}},
                    "required": ["level", "label"]}),
    ("a company", {"type": "object", "properties": {"company": {
        "type": "object", "properties": {"ceo": {
            "type": "object", "properties": {"name": S, "age": {
                "type": "integer", "minimum": 18, "maximum": 99}},
            "required": ["name", "age"]}}, "required": ["ceo"]}}, "required": ["company"]}),
    ("a line from two points", {
        "$defs": {"point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": 0, "maximum": 9},
            "y": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x", "y"],
            "additionalProperties": False}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"},
                                         "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False}),
    ("a pet", {"anyOf": [
        {"type": "object", "properties": {"cat": S}, "required": ["cat"],
         "additionalProperties": False},
        {"type": "object", "properties": {"dog": S, "age": {
            "type": "integer", "minimum": 0, "maximum": 30}}, "required": ["dog"],
         "additionalProperties": False}]}),
]

SCHEMAS = [(what, strict(schema)) for what, schema in _SCHEMAS]
