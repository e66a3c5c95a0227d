"""The listening sockets: systemd-passed fds, the default Unix socket, the optional loopback TCP listener.

The daemon creates every socket itself and hands the list to uvicorn, so each can be checked (mode, group, family)
before the first request, and so socket activation and a plain start serve through the same code.
"""

from __future__ import annotations

import grp
import os
import socket
import stat
from collections.abc import MutableMapping
from pathlib import Path

from edgekit.errors import ConfigError

from .config import DaemonConfig

SD_LISTEN_FDS_START = 3


def systemd_sockets(env: MutableMapping[str, str] | None = None) -> list[socket.socket]:
    """The sockets systemd passed (fd 3 onwards) when `LISTEN_PID` is this process; the variables are then unset
    so that children do not think the fds are theirs."""
    env = os.environ if env is None else env
    try:
        pid, count = int(env.get("LISTEN_PID", "")), int(env.get("LISTEN_FDS", ""))
    except ValueError:
        return []
    if pid != os.getpid() or count < 1:
        return []
    out = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count):
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)  # family and type are read from the fd itself
        if sock.type != socket.SOCK_STREAM:
            raise ConfigError(f"systemd passed fd {fd} that is not a stream socket")
        sock.setblocking(False)
        out.append(sock)
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(key, None)
    return out


def answers(path: Path, timeout: float = 1.0) -> bool:
    """Whether a process listens on the Unix socket at `path` (a connect that is accepted, or that waits in a full
    backlog); False for a stale socket file that nothing listens on."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except (TimeoutError, BlockingIOError):  # someone listens, but is too busy to accept now
        return True
    except OSError:  # cannot tell (e.g. no permission): replacing it is then refused by the unlink itself
        return False
    finally:
        probe.close()
    return True


def unix_socket(path: Path, mode: int = 0o660, group: str | None = None) -> socket.socket:
    """Bind `path` (replacing a stale socket, never a regular file, never one a live daemon answers on) with
    `mode` and `group` set before listen().

    Unlinking a live daemon's socket would leave that daemon running but unreachable, so a socket that accepts a
    connection is refused; one that nothing listens on (left by a crash) is replaced."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ConfigError("exists and is not a socket; refusing to replace it", path)
        if answers(path):
            raise ConfigError("another edgekitd is already listening on this socket; stop it first", path)
        try:
            path.unlink()
        except OSError as exc:
            raise ConfigError(f"cannot replace the stale socket ({exc.strerror})", path) from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~mode)  # no window where the socket is wider than asked
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot bind the Unix socket ({exc.strerror})", path) from None
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    if group:
        try:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        except (KeyError, PermissionError) as exc:
            sock.close()
            raise ConfigError(f"cannot give the socket to group {group!r} ({exc})", path) from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def tcp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot bind TCP {host}:{port} ({exc.strerror})") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def open_listeners(cfg: DaemonConfig) -> tuple[list[socket.socket], str]:
    """(sockets, how) — systemd's when activated, else the configured Unix socket; plus TCP when enabled."""
    socks = systemd_sockets()
    how = f"socket activation ({len(socks)} fd)" if socks else f"unix:{cfg.socket}"
    if not socks:
        socks = [unix_socket(cfg.socket, cfg.socket_mode, cfg.socket_group)]
    if cfg.tcp_enabled:
        socks.append(tcp_socket(cfg.tcp_host, cfg.tcp_port))
        how += f" + tcp:{cfg.tcp_host}:{cfg.tcp_port}"
    return socks, how
