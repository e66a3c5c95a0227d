"""`edgekitd --print-dicom-dropin`: the edgekitd.service drop-in that opens the network DICOM needs, and no more.

The shipped unit gives the daemon no network (PrivateNetwork=yes, RestrictAddressFamilies=AF_UNIX, IPAddressDeny=any),
which forbids the Storage SCP's bind and every delivery. Which hosts must get through depends on the config (the
SCP's senders, each destination, the TCP listener's clients), so the drop-in is printed from it, one commented
IPAddressAllow= line per address, while IPAddressDeny=any stays.

IPAddressAllow= takes addresses, not names. A host name (a destination URL's or a C-STORE host) is resolved here,
with getaddrinfo, rather than refused: refusing would push users to write IP literals into https URLs, and TLS
certificates name hosts, so the check would then fail. The comment says the addresses are those of generation time
(print the drop-in again when they change), and the resolvers in /etc/resolv.conf are allowed too, because the
daemon resolves the name again each time it delivers. A name that does not resolve is a config error naming it.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from urllib.parse import urlsplit

from edgekit.errors import ConfigError

from .config import DaemonConfig
from .dicom_config import Destination

DROPIN_PATH = "/etc/systemd/system/edgekitd.service.d/dicom.conf"
RESOLV_CONF = Path("/etc/resolv.conf")
# systemd-analyze security --offline=true, systemd 252 (tests/test_daemon_systemd.py and the booted test measure them).
EXPOSURE = "0.2 for the unit alone; with this drop-in 0.9 (localhost only) or 1.0 (other hosts)"

HEADER = f"""\
# edgekitd.service drop-in: the network edgekitd.toml's DICOM settings need, printed by
#   edgekitd --config /etc/edgekit/edgekitd.toml --print-dicom-dropin
# The shipped unit gives the daemon no network at all (PrivateNetwork=yes, AF_UNIX only, IPAddressDeny=any): the
# Storage SCP could not bind and no delivery could leave. This opens IPv4/IPv6 and lets through only the hosts below
# (IPAddressDeny=any stays; IPAddressAllow= filters both directions, by address, not by port). Install it as
#   {DROPIN_PATH}
# then: systemctl daemon-reload && systemctl restart edgekitd. Print it again when [dimse], [[destinations]] or
# [listen] change.
"""
NOTHING = """\
#
# Nothing to open: the SCP is off ([dimse] enabled = false), there are no [[destinations]] and no TCP listener.
# STOW-RS on the Unix socket needs no network, so this drop-in changes nothing.
"""


def render(cfg: DaemonConfig, resolv_conf: Path = RESOLV_CONF) -> str:
    """The drop-in for `cfg`; one that changes nothing (comments only) when no DICOM networking is configured."""
    hosts, names, notes = allowed_hosts(cfg)
    if not hosts and not notes:
        return HEADER + NOTHING + "\n[Service]\n"
    if names:
        for server in nameservers(resolv_conf):
            why = f"a resolver in {resolv_conf}: the daemon looks up {', '.join(names)} again when it delivers"
            hosts.setdefault(server, []).append(why)
    lines = [HEADER + f"# systemd-analyze security: {EXPOSURE}.\n", *(f"# {note}" for note in notes)]
    lines += ["[Service]", "PrivateNetwork=no", "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", "IPAddressDeny=any"]
    for address, whys in hosts.items():
        lines += [f"# {why}" for why in whys] + [f"IPAddressAllow={address}"]
    return "\n".join(lines) + "\n"


def allowed_hosts(cfg: DaemonConfig) -> tuple[dict[str, list[str]], list[str], list[str]]:
    """Each IPAddressAllow= entry with why it is there, in config order; the host names that were resolved; and
    notes on what could not be listed."""
    s = cfg.dicom
    out: dict[str, list[str]] = {}
    names: list[str] = []
    notes: list[str] = []

    def add(host: str, why: str, where: str) -> None:
        address = literal(host)
        found = [address] if address is not None else resolve(host, where, cfg.source)
        if address is None:
            names.append(host)
            why += f"; {host} resolves now to {' '.join(found)}: print this again if that changes"
        for item in found:
            out.setdefault(item, []).append(why)

    if s.scp:
        for peer in s.allowed:
            if peer.host == "*":
                why = f"[[dimse.allowed]] {peer.ae_title} may send from any host: no IP filter, only the AE check"
                out.setdefault("any", []).append(why)
            else:
                add(peer.host, f"the SCP's sender {peer.ae_title} from {peer.host}", f"dimse.allowed {peer.ae_title}")
    for d in s.destinations:
        add(destination_host(d), f"destination {d.describe()}", f"destination {d.name!r}")
    if cfg.tcp_enabled:
        if literal(cfg.tcp_host) == "localhost":
            out.setdefault("localhost", []).append(f"the TCP listener's clients (it binds {cfg.tcp_host})")
        else:
            notes.append(f"The TCP listener binds {cfg.tcp_host}: list its clients (IPAddressAllow=) by hand.")
    return out, list(dict.fromkeys(names)), notes


def destination_host(d: Destination) -> str:
    if d.kind == "cstore":
        return d.host or ""
    return urlsplit(d.url or "").hostname or ""


def literal(host: str) -> str | None:
    """The IPAddressAllow= entry of an IP literal (loopback: `localhost`); None for a host name."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])  # no zone index: systemd takes none
    except ValueError:
        return None
    return "localhost" if ip.is_loopback else str(ip)


def resolve(host: str, where: str, source: Path | None) -> list[str]:
    """The entries `host` resolves to now; a name that does not resolve is a config error."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:  # UnicodeError: not a valid name at all (an empty label, say)
        reason = getattr(exc, "strerror", None) or exc
        raise ConfigError(f"{where}: cannot resolve {host!r} for IPAddressAllow= ({reason})", source) from None
    return sorted({literal(str(info[4][0])) or "" for info in infos} - {""})


def nameservers(resolv_conf: Path) -> list[str]:
    """The resolvers the daemon's lookups go to (127.0.0.53, systemd-resolved's stub, is `localhost`)."""
    try:
        lines = resolv_conf.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    found = [literal(parts[1]) for parts in map(str.split, lines) if len(parts) >= 2 and parts[0] == "nameserver"]
    return list(dict.fromkeys(f for f in found if f))
