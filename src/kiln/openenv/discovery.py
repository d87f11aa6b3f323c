"""Discovery of an OpenEnv server: bounded GETs, a content-addressed identity, the compiled action schema.

Every body is read under a byte cap with redirects off; the complete JSON values of
``/metadata``, ``/schema`` and ``/openapi.json`` (and ``/list_environments`` where the
server has it) are canonicalised and hashed under :data:`DISCOVERY_DOMAIN`, so key order
and whitespace do not matter while unknown extension fields stay bound. The action schema
is compiled once per inspection with draft auto-detection and no remote resolution: a
``$ref`` that does not point inside the schema fails discovery.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kiln.canonical import canonical_json_bytes, domain_digest, strict_json_loads
from kiln.errors import InvalidRequest, KilnError

DISCOVERY_DOMAIN = "kiln.openenv-discovery.v1"
DISCOVERY_PATHS = ("/metadata", "/schema", "/openapi.json")
OPTIONAL_PATHS = ("/list_environments",)
MAX_URL_CHARS = 512


class EnvironmentProtocolError(KilnError):
    """The environment server broke the OpenEnv contract (discovery or episode); not retryable."""

    status = 502
    code = "environment_protocol_error"
    default_hint = "check that the URL serves an OpenEnv environment (openenv-core create_app)"


class EnvironmentUnavailable(KilnError):
    status = 503
    code = "environment_unavailable"
    default_hint = "start the environment server, then retry"


def check_env_url(url: str) -> str:
    """``http://<loopback>:<port>`` with no path, query or credentials; returns it without a trailing slash."""
    if len(url) > MAX_URL_CHARS:
        raise ValueError(f"env_url is longer than {MAX_URL_CHARS} characters")
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError("env_url must be a plain http://host:port URL")
    if parts.path not in ("", "/"):
        raise ValueError("env_url must not have a path: Kiln calls /metadata, /schema, /health and /ws under it")
    host = parts.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError("env_url must be on loopback (127.0.0.1, ::1 or localhost)")
    try:
        parts.port
    except ValueError as exc:
        raise ValueError(f"env_url has an invalid port: {exc}") from None
    return url.rstrip("/")


def ws_url(base: str) -> str:
    return "ws" + base[len("http"):] + "/ws"


def _external_refs(node: Any, path: str = "") -> list[str]:
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("$ref", "$dynamicRef", "$recursiveRef") and isinstance(value, str) and not value.startswith("#"):
                found.append(f"{path}/{key}")
            found.extend(_external_refs(value, f"{path}/{key}"))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.extend(_external_refs(value, f"{path}/{i}"))
    return found


def compile_action_schema(schema: Any) -> Any:
    """A validator for ``schema`` (draft auto-detected; internal ``#`` refs only, nothing fetched)."""
    import jsonschema
    from referencing import Registry

    if not isinstance(schema, dict):
        raise EnvironmentProtocolError("the environment's action schema is not a JSON object", code="invalid_action_schema")
    external = _external_refs(schema)
    if external:
        raise EnvironmentProtocolError(f"the action schema has non-local references at {external[:3]}",
                                       code="invalid_action_schema", hint="inline every $ref (Kiln resolves nothing over HTTP or files)")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise EnvironmentProtocolError(f"the action schema is invalid: {exc.message}", code="invalid_action_schema") from None
    return cls(schema, registry=Registry())  # an empty registry: an unresolvable ref fails, never fetches


def action_errors(validator: Any, action: Any, limit: int = 5) -> list[dict[str, str]]:
    """Bounded evidence: keyword and JSON Pointer of the first ``limit`` violations."""
    out = []
    for err in validator.iter_errors(action):
        pointer = "".join(f"/{p}" for p in err.absolute_path)
        out.append({"keyword": str(err.validator), "pointer": pointer, "message": err.message[:200]})
        if len(out) >= limit:
            break
    return out


@dataclass(frozen=True)
class Discovery:
    base_url: str
    documents: dict[str, Any]  # path -> complete JSON value
    digest: str
    action_schema: dict[str, Any]
    validator: Any
    name: str | None


def _get(client: Any, base: str, path: str, cap: int) -> tuple[int, bytes]:
    import httpx

    try:
        with client.stream("GET", base + path) as r:
            if r.is_redirect:
                raise EnvironmentProtocolError(f"GET {path} answered a redirect ({r.status_code}); Kiln does not follow them",
                                               code="environment_redirect")
            declared = r.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > cap:
                raise EnvironmentProtocolError(f"GET {path} declares {declared} bytes, over the {cap}-byte discovery cap",
                                               code="discovery_too_large")
            body = bytearray()
            for chunk in r.iter_raw():
                body += chunk
                if len(body) > cap:
                    raise EnvironmentProtocolError(f"GET {path} sent more than {cap} bytes", code="discovery_too_large")
            return r.status_code, bytes(body)
    except httpx.HTTPError as exc:
        raise EnvironmentUnavailable(f"GET {base}{path} failed: {exc}") from None


def check_health(client: Any, base: str, cap: int) -> None:
    status, _ = _get(client, base, "/health", cap)
    if status != 200:
        raise EnvironmentUnavailable(f"GET /health answered {status}", code="environment_unhealthy")


def discover(base_url: str, *, max_bytes: int, timeout_s: float) -> Discovery:
    """Health, then every discovery document, hashed; the action schema compiled."""
    import httpx

    base = check_env_url(base_url)
    docs: dict[str, Any] = {}
    with httpx.Client(follow_redirects=False, timeout=timeout_s, trust_env=False) as client:
        check_health(client, base, max_bytes)
        for path in DISCOVERY_PATHS + OPTIONAL_PATHS:
            status, body = _get(client, base, path, max_bytes)
            if status == 404 and path in OPTIONAL_PATHS:
                continue
            if status != 200:
                raise EnvironmentProtocolError(f"GET {path} answered {status}", code="discovery_failed")
            try:
                docs[path] = strict_json_loads(body)
            except ValueError as exc:
                raise EnvironmentProtocolError(f"GET {path} is not JSON: {exc}", code="discovery_not_json") from None
    schema = docs["/schema"]
    if not isinstance(schema, dict) or not isinstance(schema.get("action"), dict):
        raise EnvironmentProtocolError("GET /schema has no `action` object", code="invalid_action_schema")
    validator = compile_action_schema(schema["action"])
    meta = docs["/metadata"]
    name = meta.get("name") if isinstance(meta, dict) and isinstance(meta.get("name"), str) else None
    return Discovery(base, docs, discovery_digest(docs), schema["action"], validator, name)


def discovery_digest(documents: dict[str, Any]) -> str:
    return domain_digest(DISCOVERY_DOMAIN, canonical_json_bytes(documents))


def check_url_field(url: str) -> str:
    try:
        return check_env_url(url)
    except ValueError as exc:
        raise InvalidRequest(str(exc), code="invalid_env_url", param="env_url") from None
