"""Which prefill side channels a decode node may connect to (``--kv-allowed-peers``).

A decode leg names its prefill node's side channel in
``kv_transfer_params.remote_side_channel``, and D connects out to it: without a check,
anyone who can send D a request could make it open connections anywhere (a server-side
request forgery). D connects only to addresses this list allows; others are refused with
a 400 naming the field, before anything is reserved or sent.

The list is comma-separated; each entry is one of
  ``loopback``        127.0.0.0/8, ::1 and ``localhost`` (the default: one box)
  ``*``               any address (for deployments where every caller is authenticated,
                      e.g. nodes behind ``--api-key`` reached only by the proxy)
  ``HOST``            that host name or IP address, any port
  ``HOST:PORT``       that host and port (``[v6]:port`` for IPv6)
  ``CIDR``            IP addresses in that network, e.g. ``10.0.0.0/8``
Host names match by their spelling only (no DNS lookup here: an allowed name that
resolves elsewhere later is the name's owner's choice, and a lookup could be rebound).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of ``tcp://host:port``; ``ValueError`` when it is not one."""
    parts = urlsplit(address)
    if parts.scheme != "tcp" or not parts.hostname or parts.path or parts.query:
        raise ValueError(f"not a tcp://host:port address: {address!r:.80}")
    port = parts.port  # raises ValueError when out of range
    if port is None:
        raise ValueError(f"no port in {address!r:.80}")
    return parts.hostname.lower(), port


@dataclass(frozen=True)
class PeerAllowlist:
    any_peer: bool = False
    networks: tuple[IPNetwork, ...] = ()
    hosts: frozenset[str] = frozenset()
    host_ports: frozenset[tuple[str, int]] = frozenset()

    @classmethod
    def parse(cls, spec: str) -> PeerAllowlist:
        """``ValueError`` naming the entry that is not valid."""
        any_peer = False
        networks: list[IPNetwork] = []
        hosts: set[str] = set()
        host_ports: set[tuple[str, int]] = set()
        for raw in spec.split(","):
            entry = raw.strip().lower()
            if not entry:
                continue
            if entry == "*":
                any_peer = True
            elif entry == "loopback":
                networks.extend(LOOPBACK)
                hosts.add("localhost")
            elif "/" in entry:
                try:
                    networks.append(ipaddress.ip_network(entry, strict=False))
                except ValueError as e:
                    raise ValueError(f"{raw.strip()!r} is not a network: {e}") from None
            elif _is_ip(entry.strip("[]")):
                hosts.add(_canonical(entry.strip("[]")))
            elif entry.count(":") == 1 or entry.startswith("["):
                try:
                    host, port = split_address(f"tcp://{entry}")
                except ValueError as e:
                    raise ValueError(f"{raw.strip()!r} is not HOST:PORT: {e}") from None
                host_ports.add((_canonical(host), port))
            elif _is_hostname(entry):
                hosts.add(entry)
            else:
                raise ValueError(
                    f"{raw.strip()!r} is not a host, HOST:PORT, CIDR, 'loopback' or '*'"
                )
        if not (any_peer or networks or hosts or host_ports):
            raise ValueError("the list is empty (use 'loopback', hosts, CIDRs or '*')")
        return cls(any_peer, tuple(networks), frozenset(hosts), frozenset(host_ports))

    def allows(self, address: str) -> bool:
        if self.any_peer:
            return True
        try:
            host, port = split_address(address)
        except ValueError:
            return False
        host = _canonical(host)
        if host in self.hosts or (host, port) in self.host_ports:
            return True
        if not _is_ip(host):
            return False
        ip = ipaddress.ip_address(host)
        return any(ip in net for net in self.networks)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _canonical(host: str) -> str:
    """An IP address in its one spelling -- an IPv4 address written as IPv6
    (``::ffff:a.b.c.d``, which connects to that IPv4 address) as the IPv4 address, so
    that IPv4 rules, and not a broad IPv6 one, decide on it; a name as it is."""
    if not _is_ip(host):
        return host
    addr = ipaddress.ip_address(host)
    return str(getattr(addr, "ipv4_mapped", None) or addr)


def _is_hostname(text: str) -> bool:
    labels = text.split(".")
    return all(
        0 < len(label) <= 63 and all(c.isalnum() or c == "-" for c in label) for label in labels
    )


def own_address_refused(own: str, allowlist: PeerAllowlist, spec: str) -> str | None:
    """A start-up warning when this node's own side channel ``own`` is outside its
    allowlist (``spec``, as given): its peers advertise addresses like it (another host,
    or this host's non-loopback address when bound to ``0.0.0.0``), so every pairing
    would be refused and every prompt prefilled on D (through the proxy: answers stay
    right, without disaggregation). Only for a list of networks (``loopback``, CIDRs): a
    list that names hosts names the peers (P's the decode nodes, D's the prefill nodes),
    and this node's own address need not be among them."""
    names_peers = allowlist.host_ports or allowlist.hosts - {"localhost"}
    if allowlist.allows(own) or names_peers:
        return None
    return (
        f"this node's side channel {own} is outside --kv-allowed-peers {spec!r}: peers "
        "advertising addresses like it (other hosts, or this host's own non-loopback "
        "address) are refused, and every prompt is prefilled on the decode node; list "
        "the peers' hosts or networks in --kv-allowed-peers (e.g. 10.0.0.0/8) on every node"
    )
