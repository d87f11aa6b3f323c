"""Typed adapter errors.

Each is a :class:`kiln.errors.KilnError` with a stable ``code``, the status
class it maps to and a ``hint`` that tells the caller what to do.
"""

from __future__ import annotations

from kiln.errors import KilnError


class AdapterError(KilnError):
    """Base class: something about an adapter request or artifact is wrong."""

    code = "adapter_error"
    status = 400

    def __init__(self, message: str, hint: str | None = None, *, param: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message, hint=hint, param=param, retry_after=retry_after)


class AdapterNotFound(AdapterError):
    code = "adapter_not_found"
    status = 404
    default_hint = "List the stored adapters with GET /v1/adapters (or `kiln adapters list`)."


class InvalidAdapter(AdapterError):
    """The PEFT files, manifest or parameters are malformed or do not fit the base model."""

    code = "invalid_adapter"
    status = 400
    default_hint = "Save the adapter with PEFT (adapter_config.json + adapter_model.safetensors) for this base model."


class AdapterConflict(AdapterError):
    code = "adapter_conflict"
    status = 409
    default_hint = "Check the adapter's state with GET /v1/adapters."


class AdapterTooLarge(AdapterError):
    code = "adapter_too_large"
    status = 413
    default_hint = "Raise adapters.max_upload_bytes in kiln.toml if this size is intended."


class AdapterBusy(AdapterError):
    """Too many uploads are running server-wide; sent with ``Retry-After``."""

    code = "adapter_uploads_busy"
    status = 429
    default_hint = "Retry after the number of seconds in the Retry-After header."


class AdapterUnavailable(AdapterError):
    """The server could not finish the work in time (validation deadline); sent with ``Retry-After``."""

    code = "adapter_unavailable"
    status = 503
    default_hint = "Retry later; if it persists, the adapter is unusually large for this server."


class UnsafeArchive(AdapterError):
    code = "unsafe_archive"
    status = 400
    default_hint = (
        "Upload a tar.gz holding only regular files adapter_config.json and adapter_model.safetensors "
        "(optionally inside one top-level folder)."
    )


class AdapterIntegrityError(AdapterError):
    """Stored files no longer match their manifest (disk corruption or tampering)."""

    code = "adapter_integrity"
    status = 500
    default_hint = "Delete the adapter and publish it again from its source."
