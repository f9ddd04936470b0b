"""BFCL function docs to OpenAI function schemas whose ``parameters`` are valid JSON Schema (Draft 2020-12)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


class SchemaConversionError(ValueError):
    """A BFCL function doc that cannot be converted to JSON Schema (names the offending path)."""


# BFCL type name -> JSON Schema type (None: no type constraint, i.e. any JSON value).
_TYPE_MAP: dict[str, str | None] = {
    "dict": "object",
    "object": "object",
    "HashMap": "object",
    "Hashtable": "object",
    "float": "number",
    "double": "number",
    "number": "number",
    "integer": "integer",
    "int": "integer",
    "long": "integer",
    "short": "integer",
    "byte": "integer",
    "Bigint": "integer",
    "string": "string",
    "str": "string",
    "String": "string",
    "char": "string",
    "boolean": "boolean",
    "bool": "boolean",
    "array": "array",
    "list": "array",
    "tuple": "array",
    "ArrayList": "array",
    "Array": "array",
    "Queue": "array",
    "Stack": "array",
    "any": None,
    "Any": None,
}
# Annotation / validation keywords copied through unchanged.
_PASSTHROUGH_KEYS = frozenset(
    {"description", "enum", "title", "format", "pattern", "minimum", "maximum", "minItems", "maxItems", "examples"}
)


def convert_bfcl_schema(node: Mapping[str, Any], path: str = "$") -> dict[str, Any]:
    """Convert one BFCL parameter schema node to JSON Schema.

    Rules: ``type`` goes through :data:`_TYPE_MAP` (``dict``→``object``, ``float``→``number``,
    ``tuple``/``list``→``array``, ``any``→ no ``type`` keyword); ``properties``, ``items`` and
    ``additionalProperties`` are converted recursively; ``required`` keeps only its list (every name must
    be a declared property); the Python-style default ``"None"`` becomes JSON ``null``; description,
    enum and other plain annotation keywords are copied. Anything else raises
    :class:`SchemaConversionError` naming ``path`` — nothing is dropped or guessed silently.
    """
    if not isinstance(node, Mapping):
        raise SchemaConversionError(f"{path}: schema must be an object, got {type(node).__name__}")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "type":
            if not isinstance(value, str) or value not in _TYPE_MAP:
                raise SchemaConversionError(f"{path}.type: unknown BFCL type {value!r}")
            mapped = _TYPE_MAP[value]
            if mapped is not None:
                out["type"] = mapped
        elif key == "properties":
            if not isinstance(value, Mapping):
                raise SchemaConversionError(f"{path}.properties: must be an object")
            out["properties"] = {
                str(name): convert_bfcl_schema(sub, f"{path}.properties.{name}") for name, sub in value.items()
            }
        elif key in ("items", "additionalProperties"):
            out[key] = value if isinstance(value, bool) else convert_bfcl_schema(value, f"{path}.{key}")
        elif key == "required":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise SchemaConversionError(f"{path}.required: must be a list of strings")
            out["required"] = list(value)
        elif key == "default":
            out["default"] = None if value == "None" else copy.deepcopy(value)
        elif key in _PASSTHROUGH_KEYS:
            out[key] = copy.deepcopy(value)
        else:
            raise SchemaConversionError(f"{path}: unsupported schema keyword {key!r}")
    missing = [r for r in out.get("required", []) if r not in out.get("properties", {})]
    if missing:
        raise SchemaConversionError(f"{path}.required: names undeclared properties {missing}")
    return out


def convert_bfcl_function_doc(doc: Mapping[str, Any]) -> dict[str, Any]:
    """BFCL function doc → OpenAI tool ``{"type": "function", "function": {name, description, parameters}}``.

    The ``response`` schema BFCL attaches (documentation of the return value) is not part of an
    OpenAI function schema and is left out. ``parameters`` is always an object schema.
    """
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise SchemaConversionError("$.name: function doc has no name")
    params = doc.get("parameters", {"type": "dict", "properties": {}})
    converted = convert_bfcl_schema(params, path=f"{name}.parameters")
    if converted.get("type", "object") != "object":
        raise SchemaConversionError(f"{name}.parameters: must be an object schema, got {converted.get('type')!r}")
    converted["type"] = "object"
    converted.setdefault("properties", {})
    return {
        "type": "function",
        "function": {"name": name, "description": str(doc.get("description", "")), "parameters": converted},
    }


