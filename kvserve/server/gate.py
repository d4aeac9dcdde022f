"""The gate in front of the app: request ids, the Host check and the API key (pure ASGI, so
streaming is untouched).

    request -> X-Request-Id (echoed, or a fresh one) -> Host allowed? (421) -> API key (401;
               its tenant and tier into the request's state) -> the app
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import uuid
from collections.abc import Mapping, Sequence

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import APIError, error_response

LOOPBACK_NAMES = ("localhost",)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def tenant_of(api_key: str) -> str:
    """The tenant an API key stands for (Request.tenant): a stable hash, never the key, since
    it reaches the engine's per-tenant state (the suffix proposer's cache of past outputs)."""
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


class Gate:
    def __init__(self, app: ASGIApp, api_key: str | Sequence[str] | None,
                 allowed_hosts: tuple[str, ...] | None = None,
                 public_paths: Sequence[str] = ("/health",),
                 key_tiers: Mapping[str, str] | None = None) -> None:
        """public_paths: exact paths answered without a key (/health; the web page's files,
        which hold no data and ask for the key themselves). key_tiers: more keys, each with
        its service tier (the others are in the default tier)."""
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
        tiers: dict[str, str | None] = dict.fromkeys((k for k in keys if k), None)
        tiers.update(key_tiers or {})
        self.api_keys = [(k.encode(), tenant_of(k), t) for k, t in tiers.items()]
        self.allowed_hosts = allowed_hosts
        self.public_paths = frozenset(public_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        rid = headers.get("x-request-id", "")
        if not _REQUEST_ID.fullmatch(rid):
            rid = uuid.uuid4().hex  # absent, or not safe to echo into headers and logs
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = rid
            await send(message)

        host = headers.get("host")
        if host is not None and not host_allowed(host, self.allowed_hosts):
            # Before the key: a rebinding page must learn nothing, not even that a key is due.
            err = APIError(421, f"the Host header {host[:100]!r} is not one this server "
                                f"answers to (see --allowed-host)", code="invalid_host")
            await error_response(err).__call__(scope, receive, send_with_id)
            return
        if self.api_keys and scope.get("path") not in self.public_paths:
            found = self._tenant(headers)
            if found is None:
                err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer "
                                    "<key>'", code="invalid_api_key")
                await error_response(err).__call__(scope, receive, send_with_id)
                return
            scope["state"]["tenant"], scope["state"]["tier"] = found
        await self.app(scope, receive, send_with_id)

    def _tenant(self, headers: Headers) -> tuple[str, str | None] | None:
        """(tenant, tier) of the key the request sends; None when it sends none of the
        keys."""
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        sent = token.strip().encode()
        found = None
        # Constant time in the key, and every key compared: a timing side channel must not
        # reveal a matching prefix.
        for key, tenant, tier in self.api_keys:
            if hmac.compare_digest(sent, key) and found is None:
                found = tenant, tier
        return found if scheme.lower() == "bearer" else None


def host_allowed(host: str, allowed: tuple[str, ...] | None) -> bool:
    """host: a Host header ("name", "name:port", "[::1]:port"). allowed: names or IP literals;
    "loopback" stands for localhost and every loopback address."""
    if allowed is None:
        return True
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    if name in allowed:
        return True
    if "loopback" in allowed:
        if name in LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False
    return False
