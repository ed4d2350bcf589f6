"""The entries of a CE's --prefill-url and the rendezvous order of PEs (pure functions: the config
checks the flag with them; pd/pe_pool.py uses them to pick PEs)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from urllib.parse import urlsplit

PE_ROUTING = ("affinity", "least-loaded", "round-robin")
DNS_SCHEME = "dns+"


@dataclass(frozen=True)
class Target:
    """One entry of --prefill-url: a fixed URL, or (dns) a name whose addresses are the PEs."""

    url: str  # as written, minus a trailing slash
    dns: bool = False

    @property
    def scheme(self) -> str:
        return urlsplit(self.url.removeprefix(DNS_SCHEME)).scheme

    @property
    def host(self) -> str:
        return urlsplit(self.url.removeprefix(DNS_SCHEME)).hostname or ""

    @property
    def port(self) -> int:
        return urlsplit(self.url.removeprefix(DNS_SCHEME)).port or (443 if self.scheme == "https" else 80)


def parse_prefill_urls(value: str) -> list[Target]:
    """The targets of a --prefill-url value (comma-separated); ValueError names the bad entry."""
    targets: list[Target] = []
    for raw in value.split(","):
        entry = raw.strip().rstrip("/")
        if not entry:
            raise ValueError(f"--prefill-url has an empty entry: {value!r}")
        dns = entry.startswith(DNS_SCHEME)
        parts = urlsplit(entry.removeprefix(DNS_SCHEME))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"--prefill-url entry {entry!r} is not http(s)://HOST:PORT or dns+http(s)://NAME:PORT"
            )
        try:
            parts.port  # noqa: B018 (a port out of range raises here)
        except ValueError as e:
            raise ValueError(f"--prefill-url entry {entry!r}: {e}") from None
        if parts.path or parts.query or parts.fragment:
            raise ValueError(f"--prefill-url entry {entry!r} must not have a path")
        if dns and parts.port is None:
            raise ValueError(f"--prefill-url entry {entry!r} needs a port")
        t = Target(entry, dns)
        if t in targets:
            raise ValueError(f"--prefill-url names {entry!r} twice")
        targets.append(t)
    return targets


def url_of(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"


def hrw_order(key: str, urls: list[str]) -> list[str]:
    """The urls by rendezvous weight for key, highest first (the same on every CE)."""
    data = key.encode("utf-8", "surrogatepass")

    def weight(url: str) -> bytes:
        return hashlib.blake2b(data, digest_size=8, key=url.encode()[:64]).digest()

    return sorted(urls, key=weight, reverse=True)
