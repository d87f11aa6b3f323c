"""Integers as JSON Schema counts them: ``5.0`` is an integer, ``5.5``, ``"5"`` and ``true`` are not.

The OpenAI wire models validate strictly (a string or a boolean is never a number), but JSON Schema's
``"type": "integer"`` matches any number whose fractional part is zero, so a client or fuzzer that follows
the published document may send ``412.0`` for ``top_k``. :data:`WireInt` accepts it as ``412``;
:func:`integral_lists` does the same for token-ID lists. Both first run the strict validation unchanged and
convert only when it failed, so a valid request pays nothing and every refusal the strict model made for any
other reason (a bool, a string, a fraction, a bound) is still made, with the same message.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ValidationError, ValidatorFunctionWrapHandler, WrapValidator


def _integral(value: Any) -> Any:
    """``value`` with every float that is a whole number (in nested lists too) made an int; else ``value``."""
    if type(value) is float and value.is_integer():  # type() is: a bool is not a float, and stays refused
        return int(value)
    if type(value) is list:
        items = [_integral(v) for v in value]
        return items if any(a is not b for a, b in zip(items, value, strict=True)) else value
    return value


def lenient_integers(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Strict validation first; only if it fails, once more with whole-number floats as ints."""
    try:
        return handler(value)
    except ValidationError:
        whole = _integral(value)
        if whole is value:
            raise
        return handler(whole)


integral_lists = WrapValidator(lenient_integers)
"""Put last in an ``Annotated`` list (or scalar) type: the whole value is retried once, not each item."""

WireInt = Annotated[int, integral_lists]
