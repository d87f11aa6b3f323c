"""Secrets named by environment variable: ``[teachers.credentials.<id>] origin, api_key_env`` in kiln.toml.

Only the variable's NAME and the authorized origin live in settings. The secret
is checked at start-up (:func:`validate_credentials`), checked again when a
handle is resolved, and read from the environment immediately before each
outbound request (:meth:`CredentialHandle.bearer`). It is never stored on an
object, serialised, logged or echoed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from kiln.errors import NotFound, Unavailable

# a credential's <id> in kiln.toml (config) and a teacher registration's ``credential_id`` (published in /openapi.json)
CREDENTIAL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class CredentialError(Unavailable):
    code = "teacher_credential_unavailable"


def _secret_problem(name: str, environ: Mapping[str, str]) -> str | None:
    value = environ.get(name)
    if value is None:
        return f"environment variable {name} is not set"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return f"environment variable {name} is not valid Unicode"
    if not value.strip():
        return f"environment variable {name} is empty or whitespace"
    return None


def validate_credentials(credentials: Mapping[str, object], environ: Mapping[str, str] | None = None) -> None:
    """Start-up check: every configured credential's variable holds a usable secret (ValueError otherwise)."""
    environ = os.environ if environ is None else environ
    for cid, cred in credentials.items():
        problem = _secret_problem(cred.api_key_env, environ)  # type: ignore[attr-defined]
        if problem is not None:
            raise ValueError(f"[teachers.credentials.{cid}]: {problem}; export it before `kiln serve`")


@dataclass(frozen=True)
class CredentialHandle:
    """A reference to a configured credential: its id, origin and variable NAME (never the value)."""

    credential_id: str
    origin: str
    api_key_env: str

    def bearer(self) -> dict[str, str]:
        """The Authorization header, read from the environment now (fails closed)."""
        problem = _secret_problem(self.api_key_env, os.environ)
        if problem is not None:
            raise CredentialError(f"teacher credential {self.credential_id!r} is unusable: {problem}",
                                  hint="set the variable in the server's environment and restart")
        return {"Authorization": "Bearer " + os.environ[self.api_key_env].strip()}

    def __repr__(self) -> str:  # never the secret; not even the variable's name in reprs
        return f"CredentialHandle({self.credential_id!r}, origin={self.origin!r})"


def resolve_credential(credentials: Mapping[str, object], credential_id: str) -> CredentialHandle:
    cred = credentials.get(credential_id)
    if cred is None:
        # a resource the request names that this server does not have (its configuration's): 404
        raise NotFound(f"credential_id {credential_id!r} is not configured", code="unknown_credential",
                       param="credential_id",
                       hint="add [teachers.credentials.<id>] origin and api_key_env to kiln.toml and restart")
    handle = CredentialHandle(credential_id, cred.origin, cred.api_key_env)  # type: ignore[attr-defined]
    problem = _secret_problem(handle.api_key_env, os.environ)
    if problem is not None:
        raise CredentialError(f"teacher credential {credential_id!r} is unusable: {problem}",
                              hint="set the variable in the server's environment and restart")
    return handle
