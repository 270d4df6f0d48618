"""Constrained decoding: a request's output held to a grammar (JSON Schema,
regex, choice, Lark/GBNF) with llguidance token masks."""

from engine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
