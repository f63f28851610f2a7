"""Where a webhook may point: http(s) only, and never at an address inside the node's own
networks (loopback, private, link-local, multicast, reserved, unspecified) unless configuration
allows it: ``DISPACH_WEBHOOK_ALLOW_PRIVATE=1``, or ``DISPACH_WEBHOOK_ALLOW`` listing host names
and CIDRs. Checked when a subscription is made (a 400) and again at every delivery, on the
addresses the connection then uses (:class:`CheckedResolver`: DNS may have changed)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Mapping
from urllib.parse import urlsplit

import aiohttp.abc
import msgspec
from aiohttp.resolver import ThreadedResolver

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class TargetPolicy(msgspec.Struct, frozen=True, kw_only=True):
    allow_private: bool = False
    hosts: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TargetPolicy:
        hosts, networks = set(), []
        for item in (i.strip() for i in env.get("DISPACH_WEBHOOK_ALLOW", "").split(",")):
            if not item:
                continue
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                hosts.add(item.lower().rstrip("."))
        allow = env.get("DISPACH_WEBHOOK_ALLOW_PRIVATE", "").strip().lower() in ("1", "true", "yes")
        return cls(allow_private=allow, hosts=frozenset(hosts), networks=tuple(networks))


class TargetRefused(OSError):
    """A target resolved to an address the policy refuses (raised inside aiohttp's connect)."""


def internal(address: Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return (address.is_loopback or address.is_private or address.is_link_local
            or address.is_multicast or address.is_reserved or address.is_unspecified)  # fmt: skip


def refusal(policy: TargetPolicy, host: str, addresses: list[str]) -> str | None:
    """Why ``host`` (resolved to ``addresses``) is refused, or None."""
    if policy.allow_private or host.lower().rstrip(".") in policy.hosts:
        return None
    for raw in addresses:
        address = ipaddress.ip_address(raw.split("%", 1)[0])
        if internal(address) and not any(address in n for n in policy.networks):
            return f"{host} resolves to {address}, an internal address"
    return None


def url_problem(url: str) -> str | None:
    """Why ``url`` is no webhook URL, or None."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as e:
        return f"the URL does not parse: {e}"
    if parts.scheme not in ("http", "https"):
        return "only http and https URLs are webhooks"
    if not parts.hostname:
        return "the URL names no host"
    if parts.username or parts.password:
        return "credentials in the URL are not kept secret: sign with the secret instead"
    return None


def literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve(host: str, port: int) -> list[str]:
    """The host's addresses (a literal is its own); raises OSError when it has none."""
    if literal(host):
        return [host]
    found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in found})


class CheckedResolver(aiohttp.abc.AbstractResolver):
    """aiohttp's resolver that refuses internal addresses: the connection goes to the
    addresses checked here, never to another answer of the DNS."""

    def __init__(self, policy: TargetPolicy) -> None:
        self._policy = policy
        self._inner = ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[aiohttp.abc.ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        why = refusal(self._policy, host, [r["host"] for r in found])
        if why is not None:
            raise TargetRefused(why)
        return found

    async def close(self) -> None:
        await self._inner.close()
