"""Cross-field request rules written into the published JSON Schema.

A validator that refuses a combination of fields (``revision`` without ``adapter``, ``set_default_on_pass``
without ``activate_on_pass``) makes the OpenAPI document looser than the server unless the schema states the
same rule. JSON Schema 2020-12 (OpenAPI 3.1) can: ``if``/``then`` for "when this field looks like this, that
one must look like that", ``not`` for "never both". These helpers build those fragments for a model's
``json_schema_extra`` so clients and fuzzers read the rule the validator enforces. Pure: no imports beyond
the standard library.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def field_is(name: str, schema: Schema) -> Schema:
    """The object has ``name`` and its value matches ``schema``."""
    return {"properties": {name: schema}, "required": [name]}


def when(condition: Schema, then: Schema) -> Schema:
    """If the object matches ``condition``, it must match ``then``."""
    return {"if": condition, "then": then}


def never_both(a: Schema, b: Schema) -> Schema:
    """The object does not match ``a`` and ``b`` at once."""
    return {"not": {"allOf": [a, b]}}


def rules(*parts: Schema) -> Schema:
    """A ``json_schema_extra`` holding every rule in ``parts`` (each must hold)."""
    return {"allOf": list(parts)}


NOT_NULL: Schema = {"not": {"type": "null"}}

# "not blank" as a JSON Schema pattern (an unanchored search): one character that str.isspace() calls no space
NOT_BLANK_SCHEMA: Schema = {"pattern": r"[^\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"}
