"""Strict structured output: a JSON schema whose unspecified openings are closed.

JSON Schema leaves an object open unless it says ``additionalProperties: false``, and an array
with ``prefixItems`` open to more items unless it says ``items: false``. Grammar-constrained
decoding takes that literally: a random or weak model that is free to add a key keeps adding
keys until ``max_tokens`` (``{"city":"Paris","+`` ...). vLLM's default structured-output backend
(xgrammar) runs in strict mode, where both openings are closed unless the schema says otherwise
(its guidance backend does the same with ``disable_additional_properties``). Kiln does the same
by default: :func:`close_schema` returns the schema with every object schema that does not say
``additionalProperties`` (nor ``unevaluatedProperties``) closed and every ``prefixItems`` array
that does not say ``items`` (nor ``unevaluatedItems``) closed. A request opts out with
``allow_additional_properties: true`` (docs/serving.md).

The members of an ``allOf`` are left as they are (each would forbid the others' properties);
their own subschemas are still closed. Pure Python, iterative (a deep schema never hits the
recursion limit), and the input is never modified.
"""

from __future__ import annotations

from typing import Any

# keywords whose value is one subschema / a list of subschemas / a name -> subschema map
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalProperties")
_MANY = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OBJECT_WORDS = ("properties", "patternProperties", "required", "minProperties", "maxProperties")


def _is_object_schema(node: dict[str, Any]) -> bool:
    t = node.get("type")
    if t == "object" or (isinstance(t, list) and "object" in t):
        return True
    return t is None and any(k in node for k in _OBJECT_WORDS)


def close_schema(schema: Any) -> Any:
    """``schema`` with its unspecified ``additionalProperties`` / ``items`` after ``prefixItems`` closed."""
    if not isinstance(schema, dict):
        return schema
    root: dict[str, Any] = {}
    # (source node, its copy to fill, whether it is a direct member of an allOf)
    stack: list[tuple[dict[str, Any], dict[str, Any], bool]] = [(schema, root, False)]
    while stack:
        src, dst, in_all_of = stack.pop()
        for key, value in src.items():
            dst[key] = _child(key, value, stack)
        if in_all_of:
            continue
        if _is_object_schema(src) and "additionalProperties" not in src and "unevaluatedProperties" not in src:
            dst["additionalProperties"] = False
        if "prefixItems" in src and "items" not in src and "unevaluatedItems" not in src:
            dst["items"] = False
    return root


def _child(key: str, value: Any, stack: list) -> Any:
    """The copy of ``src[key]``; subschemas in it are queued to be copied and closed."""

    def sub(node: Any, in_all_of: bool = False) -> Any:
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        stack.append((node, out, in_all_of))
        return out

    if isinstance(value, list) and (key in _MANY or key == "items"):  # items as a list: draft-4 tuples
        return [sub(v, key == "allOf") for v in value]
    if key in _MAP and isinstance(value, dict):
        return {name: sub(v) for name, v in value.items()}
    if key in _ONE:
        return sub(value)
    return value  # enum, const, default, examples, x-guidance ...: data, never schemas
