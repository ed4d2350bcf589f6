"""Membership of a list-of-servers flag (a CE's --prefill-url, a router's --decode-url): the URLs its
targets stand for now, a dns+ name for every address it resolves to; and the rendezvous (highest-random-
weight) order in which every CE and router replica ranks those URLs for a conversation.

A dns+ target whose lookup fails keeps the URLs it had (a resolver's hiccup must not empty a pool); a
URL's identity is scheme://address:port, so that every member given the same list ranks the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import socket
from collections.abc import Mapping

from pd.config import Target

log = logging.getLogger(__name__)


async def resolve(host: str, port: int) -> list[str]:
    """Every address host resolves to (sorted, so that the order does not depend on the resolver)."""
    if _is_ip(host):
        return [host]
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def url_of(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"


async def members(
    targets: list[Target], known: Mapping[str, str], what: str
) -> tuple[dict[str, str], str | None]:
    """URL -> the target (as written) it comes from, for every target in order, each dns one looked up
    now; and the error of the last lookup that failed (None if none did). known: the URLs held so far,
    each with its target: a target whose lookup fails keeps them. what names a member in the log."""
    wanted: dict[str, str] = {}
    error: str | None = None
    for t in targets:
        if not t.dns:
            wanted.setdefault(t.url, t.url)
            continue
        try:
            urls = [url_of(t.scheme, a, t.port) for a in await resolve(t.host, t.port)]
        except OSError as e:
            error = f"{t.url}: {e}"
            urls = [u for u, source in known.items() if source == t.url]
            log.warning("cannot resolve %s (keeping its %d %s(s)): %s", t.url, len(urls), what, e)
        for url in urls:
            wanted.setdefault(url, t.url)
    return wanted, error


def hrw_order(key: str, urls: list[str]) -> list[str]:
    """The urls by rendezvous weight for key, highest first (the same on every CE and router)."""
    data = key.encode("utf-8", "surrogatepass")

    def weight(url: str) -> bytes:
        return hashlib.blake2b(data, digest_size=8, key=url.encode()[:64]).digest()

    return sorted(urls, key=weight, reverse=True)
