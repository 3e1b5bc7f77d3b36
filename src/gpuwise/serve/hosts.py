"""Which web pages may reach a gpuwise server (`serve` and `ui`): the Host allow-list and the Origin rule.

A keyless server on loopback is reachable by any page the user opens, through DNS rebinding: the page's own
name is made to resolve to 127.0.0.1, and the browser then treats the server as the page's origin (Ollama's
CVE-2024-28224). The Host header still carries the page's name, so the server answers only the names that are
its own: loopback (localhost, 127.x, [::1]), the address it is bound to, and each `--allowed-host`. A page of
another origin reaching the server by its real name is told apart by its Origin header (Sec-Fetch-Site where a
browser sends no Origin): it is refused, unless the server was told to let it in (`serve --cors-origin`).

No library does this for an ASGI app: Starlette's TrustedHostMiddleware takes a fixed list (no loopback
addresses by pattern, no ports) and answers in plain text, and nothing checks Origin. Guard (serve/app.py)
calls `WebPolicy.refusal` first on every request, for `serve` and `ui` alike.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gpuwise.errors import GpuwiseError

WILDCARDS = ("0.0.0.0", "::", "")  # a bind on every address
SAFE_METHODS = (b"GET", b"HEAD", b"OPTIONS")
_NOT_IN_A_NAME = set("/\\@?#%*, \t\r\n")


def split_host(value: str) -> tuple[str, int | None]:
    """'name', 'name:port', '10.0.0.1:port', '[::1]:port' (a Host header, or a --host / --allowed-host value)
    as (its name or address, lower case and canonical, and its port or None); ValueError when it is none."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        if end < 0:
            raise ValueError(value)
        name, rest = str(ipaddress.IPv6Address(v[1:end])), v[end + 1 :]
    elif v.count(":") > 1:  # a bare IPv6 address, as --host takes it
        name, rest = v, ""
    else:
        name, colon, port = v.partition(":")
        rest = colon + port
    port_number = None
    if rest:
        digits = rest[1:]
        if rest[0] != ":" or not (digits.isascii() and digits.isdigit()) or int(digits) > 65535:
            raise ValueError(value)
        port_number = int(digits)
    name = name[:-1] if name.endswith(".") else name  # "localhost." is the fully qualified "localhost"
    if not name or _NOT_IN_A_NAME & set(name) or not name.isascii():
        raise ValueError(value)
    return _canonical(name), port_number


def _canonical(name: str) -> str:
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return name
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is 127.0.0.1
    return str(mapped or ip)


def is_loopback_name(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def allowed_hosts(values: list[str] | None, flag: str = "--allowed-host") -> tuple[str, ...]:
    """The --allowed-host values as names (a port given is ignored: any port is the server's); one line for a
    value that names no host, '*' included, since a wildcard would let any page in through DNS rebinding."""
    out = []
    for value in values or []:
        try:
            out.append(split_host(value)[0])
        except ValueError:
            why = "a wildcard would let any web page in through DNS rebinding; " if "*" in value else ""
            raise GpuwiseError(
                f"{flag} {value!r}: {why}give a host name or address (e.g. gpu-box.lan), as browsers send it in Host"
            ) from None
    return tuple(out)


@dataclass(frozen=True)
class WebPolicy:
    """What one server accepts. `bound`: the address it listens on; `keyed`: whether every request needs a
    key (a bind on every address does: `check_key`); `cors_origins`: the origins --cors-origin lets in;
    `cors_flag`: the option that names them, for the refusal's hint (None where the server has none)."""

    bound: str = "127.0.0.1"
    allowed: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    keyed: bool = False
    cors_flag: str | None = "--cors-origin"
    _bound: str = field(init=False, repr=False, default="")

    def __post_init__(self):
        try:
            bound = split_host(self.bound)[0] if self.bound not in WILDCARDS else self.bound
        except ValueError:
            bound = self.bound.lower()
        object.__setattr__(self, "_bound", bound)

    @property
    def any_host(self) -> bool:
        # On every address the machine's names and addresses are not knowable (DHCP, VPNs, a name in a
        # proxy's config); a key is required there, and it is what stops a rebinding page, which cannot know it.
        return self.keyed and self.bound in WILDCARDS

    def host_ok(self, name: str) -> bool:
        return self.any_host or is_loopback_name(name) or name == self._bound or name in self.allowed

    def refusal(self, scope: dict, forwards: bool = False) -> tuple[int, str] | None:
        """(status, one line) for a request a page of another site sent, or that names another host; None
        to let it through. `forwards`: the path acts for the page (the ui's forwarding) even on a GET."""
        hosts = [v for k, v in scope["headers"] if k == b"host"]
        if not hosts:
            if scope.get("http_version") == "1.0":  # HTTP/1.0 has no Host; no browser sends it
                return None
            return 400, "no Host header: HTTP/1.1 requires one"
        try:
            if len(hosts) > 1:
                raise ValueError
            name, port = split_host(hosts[0].decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            return 400, f"Host header {hosts[0][:80].decode('latin-1')!r} is not a host[:port]"
        if not self.host_ok(name):
            return 421, (
                f"Host {name[:80]!r} is not a name of this server (a page reaching it through DNS rebinding?); "
                f"start it with --allowed-host {name[:80]} if it is"
            )
        origin = next((v for k, v in scope["headers"] if k == b"origin"), None)
        if origin is not None:
            text = origin.decode("latin-1")
            if self._same_origin(text, name, port) or self._cors_allowed(text):
                return None
            hint = f"; start the server with {self.cors_flag} {text[:80]} to allow it" if self.cors_flag else ""
            return 403, f"a request from the page at {text[:80]!r} (another origin) is refused{hint}"
        acts = scope.get("method", "").encode() not in SAFE_METHODS or forwards
        site = next((v for k, v in scope["headers"] if k == b"sec-fetch-site"), None)
        if acts and site == b"cross-site":  # a browser that sent no Origin still says where the request came from
            return 403, "a request from another site's page is refused (Sec-Fetch-Site: cross-site)"
        return None

    @staticmethod
    def _same_origin(origin: str, name: str, port: int | None) -> bool:
        """Whether `origin` is this server's own as the request named it: the same host and port (the port the
        Host header left out is the scheme's default). The scheme is not compared: behind a TLS proxy the
        server sees http while the page is https."""
        try:
            parts = urlsplit(origin)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                return False
            origin_name, _ = split_host(parts.netloc.rpartition("@")[2])
            default = 443 if parts.scheme == "https" else 80
            return origin_name == name and (parts.port or default) == (port or default)
        except ValueError:  # "null" (a sandboxed frame, a file), or a malformed one
            return False

    def _cors_allowed(self, origin: str) -> bool:
        wanted = origin.strip().rstrip("/").lower()
        return any(o == "*" or o.rstrip("/").lower() == wanted for o in self.cors_origins)
