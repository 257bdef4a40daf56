"""Who may talk to the server, checked before any route sees a request (an ASGI middleware):

- **API key** (``serve --api-key``): every ``/v1/`` route wants it, as OpenAI's ``Authorization: Bearer KEY`` or
  Anthropic's ``x-api-key: KEY`` (what the official clients send), compared in constant time; so do ``/metrics``,
  ``/tokenize`` and ``/detokenize`` (vLLM serves those without its key: here they are guarded, the conservative
  choice; a Prometheus scrape sends the key as ``authorization: {credentials: KEY}``). ``/health`` stays open.
  A bind beyond loopback needs a key, or ``--insecure`` to say that an open server is meant.
- **Host** (DNS rebinding): a loopback bind answers only requests whose ``Host`` names loopback (``localhost``,
  ``127.0.0.1``, ``[::1]``) or one of ``--allowed-hosts``: a web page whose own name was made to resolve to
  127.0.0.1 sends its own name.
- **Origin** (cross-site requests): a browser marks every cross-origin request with ``Origin``, a ``text/plain``
  POST a page may send without asking included. Such requests are refused unless ``--allowed-origins`` lists the
  origin (``*``: any); a listed one gets the CORS headers and its preflight answered. Clients that are not
  browsers send no ``Origin`` and are not affected.

Refusals take the error shape of the API the path belongs to (401 for the key, 403 otherwise).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from dataclasses import dataclass

from .http import ApiError, error_body, is_anthropic

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
CORS_HEADERS = "authorization, content-type, x-api-key, x-session-id, anthropic-version, anthropic-beta"
KEYED_PATHS = frozenset({"/metrics", "/tokenize", "/detokenize"})  # outside /v1/, yet behind the API key


def is_loopback(host: str) -> bool:
    """Whether a bind address (or a Host name) reaches this machine only."""
    name = host.strip("[]").lower()
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def needs_key(path: str) -> bool:
    """Whether a request to ``path`` must carry the API key (when the server has one): every ``/v1/`` route, and the
    ones outside it that read the model or the traffic (vLLM leaves these open; here the key guards them too)."""
    return path.startswith("/v1/") or path in KEYED_PATHS


def host_name(header: str) -> str:
    """The name of a ``Host`` header, without its port (``[::1]:8080`` -> ``::1``), lower-cased."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.index("]")] if "]" in h else h[1:]
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    """``api_key`` None: no key; ``hosts`` None: any Host; ``origins``: browser origins allowed (``*``: any)."""

    api_key: str | None = None
    hosts: frozenset[str] | None = None
    origins: frozenset[str] = frozenset()

    @classmethod
    def for_bind(cls, bind: str, api_key: str | None, hosts=(), origins=()) -> "AccessPolicy":
        """A loopback bind checks Host against loopback names and ``hosts``; any other bind only against ``hosts``
        when some are given."""
        named = frozenset(host_name(h) for h in hosts)
        allowed = (LOOPBACK_NAMES | named) if is_loopback(bind) else (named or None)
        return cls(api_key or None, allowed, frozenset(o.rstrip("/") for o in origins))

    def key_ok(self, headers: dict[str, str]) -> bool:
        auth = headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
        return hmac.compare_digest(given.encode(), self.api_key.encode())


class AccessGuard:
    """The ASGI middleware applying an :class:`AccessPolicy`."""

    def __init__(self, app, policy: AccessPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        p = self.policy
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if p.hosts is not None and host_name(headers.get("host", "")) not in p.hosts:
            return await _refuse(send, path, 403, f"host {headers.get('host', '')!r} is not served here (a loopback "
                                                  f"server answers loopback names; serve --allowed-hosts adds others)",
                                 "host_not_allowed")
        origin = headers.get("origin")
        cors: list[tuple[bytes, bytes]] = []
        if origin is not None:
            if "*" not in p.origins and origin.rstrip("/") not in p.origins:
                return await _refuse(send, path, 403, f"cross-origin requests from {origin!r} are refused (serve "
                                                      f"--allowed-origins lists the origins a browser may use)",
                                     "origin_not_allowed")
            cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:  # the preflight
                return await _send(send, 204, b"", cors + [
                    (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
                    (b"access-control-allow-headers", CORS_HEADERS.encode()), (b"access-control-max-age", b"600")])
        if p.api_key is not None and needs_key(path) and not p.key_ok(headers):
            anthropic = is_anthropic(path)
            msg = "invalid x-api-key" if anthropic else "Incorrect API key provided (serve --api-key): send it as " \
                                                        "Authorization: Bearer KEY"
            return await _refuse(send, path, 401, msg, "invalid_api_key", cors)
        if not cors:
            return await self.app(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + cors}
            await send(message)

        return await self.app(scope, receive, send_with_cors)


async def _refuse(send, path: str, status: int, message: str, code: str, extra=()) -> None:
    body = json.dumps(error_body(ApiError(status, message, code=code), is_anthropic(path))).encode()
    await _send(send, status, body, [(b"content-type", b"application/json"), *extra])


async def _send(send, status: int, body: bytes, headers) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})
