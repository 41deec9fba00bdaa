"""What every request passes before a route sees it, and what every response carries.

- **Host**: a request whose ``Host`` names something other than what this viewer listens as (loopback
  names, the ``--host`` given, this machine's names when it listens on every interface, ``--allow-host``)
  is refused: a page of another site whose name was re-pointed at this machine (DNS rebinding) cannot
  read the viewer. An IP address as Host is always accepted: a rebinding needs a name.
- **Token** (when one is set; always when the viewer listens beyond loopback): every request carries it,
  as ``?token=`` once (answered with a cookie and a redirect to the same URL without it, so it stays out
  of the address bar and of Referer headers), then as that cookie, or as ``Authorization: token T``.
- **Headers** on every response: a CSP that runs only this origin's script files (no inline script,
  handler or style), refuses framing, and sandboxes every file and media response; ``nosniff``;
  ``X-Frame-Options: DENY``; no Referer; same-origin resource and opener policies.

A pure ASGI middleware (no BaseHTTPMiddleware): streamed responses and byte ranges pass unchanged.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import socket
from http.cookies import SimpleCookie
from urllib.parse import parse_qsl, quote, urlencode

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; media-src 'self'; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
}
SANDBOXED = ("/files/", "/media/")  # bytes from the data: no script, no plugin, an opaque origin if opened
TOKEN_ENV = "REELCACHE_VIEW_TOKEN"


def check_token(token: str) -> str:
    """A token as a URL's query and a cookie carry it unchanged, or one line saying what is allowed."""
    from reelcache import UserError

    if not re.fullmatch(r"[A-Za-z0-9._~-]{16,256}", token):
        raise UserError(f"--token / ${TOKEN_ENV}: 16 to 256 of A-Z a-z 0-9 . _ ~ - (got {len(token)} characters)")
    return token


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::")


def host_names(host: str, allow: list[str] | tuple = ()) -> set[str]:
    """The names a Host header may carry for a viewer bound to ``host``: loopback names, ``host`` itself,
    on every interface this machine's names too, and the operator's ``allow``."""
    names = {*LOOPBACK_NAMES, host, *allow}
    if wildcard(host):
        names |= {socket.gethostname(), socket.getfqdn()}
    return {n.lower().rstrip(".") for n in names if n}


def _host_of(value: str) -> str:
    """The name of a Host header, without its port (``[::1]:8050`` -> ``::1``)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0].rstrip(".") if value.count(":") == 1 else value.rstrip(".")


def host_allowed(value: str, names: set[str]) -> bool:
    name = _host_of(value)
    try:
        ipaddress.ip_address(name)
        return True  # an address: no name to re-point
    except ValueError:
        return name in names


class Guard:
    def __init__(self, app, names: set[str], token: str | None):
        self.app, self.names, self.token = app, names, token

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if not host_allowed(host, self.names):
            shown = ", ".join(sorted(self.names))
            return await _plain(
                send,
                403,
                f"refused: Host {host!r} is not a name this viewer listens as ({shown}; --allow-host adds one)",
            )
        if self.token:
            query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
            given = [v for k, v in query if k == "token"]
            cookie = _cookie_name(scope)
            if given and _same(given[-1], self.token):
                rest = urlencode([(k, v) for k, v in query if k != "token"])
                path = scope.get("raw_path") or quote(scope["path"]).encode()  # as sent: '#', quotes encoded
                where = scope.get("root_path", "") + path.decode("latin-1") + (f"?{rest}" if rest else "")
                return await _plain(
                    send, 303, "the token is now a cookie of this browser",
                    {"location": where, "set-cookie": f"{cookie}={self.token}; HttpOnly; SameSite=Strict; Path=/"},
                )  # fmt: skip
            jar = SimpleCookie()
            try:
                jar.load(headers.get("cookie", ""))
            except Exception:  # noqa: BLE001 - a malformed cookie header is no token
                jar = SimpleCookie()
            auth = headers.get("authorization", "")
            ok = (cookie in jar and _same(jar[cookie].value, self.token)) or (
                auth.lower().startswith("token ") and _same(auth[6:].strip(), self.token)
            )
            if not ok:
                return await _plain(
                    send, 403, "refused: this viewer needs its token: open the URL it printed (ending in ?token=...)"
                )

        sandbox = scope["path"].startswith(SANDBOXED)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                have = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k.encode(), v.encode()) for k, v in HEADERS.items() if k.encode() not in have]
                csp = CSP + ("; sandbox" if sandbox else "")
                extra.append((b"content-security-policy", csp.encode()))
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        return await self.app(scope, receive, send_with_headers)


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _cookie_name(scope) -> str:
    """One cookie per port: cookies are shared by every port of a host, and two viewers have two tokens."""
    server = scope.get("server") or (None, None)
    return f"reelcache-view-{server[1] or 0}"


async def _plain(send, status: int, text: str, headers: dict | None = None) -> None:
    body = (text + "\n").encode()
    h = {"content-type": "text/plain; charset=utf-8", "content-length": str(len(body)), **HEADERS,
         "content-security-policy": CSP, **(headers or {})}  # fmt: skip
    await send(
        {"type": "http.response.start", "status": status, "headers": [(k.encode(), v.encode()) for k, v in h.items()]}
    )
    await send({"type": "http.response.body", "body": body})
