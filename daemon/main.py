"""`edgekitd`: parse flags, read the config, open the sockets, serve; systemd-style signals and notifications.

SIGTERM/SIGINT: STOPPING=1, stop accepting, let in-flight requests and running reports finish (drain timeout),
leave queued jobs in the store. SIGHUP: reload the config file. Exit status 0 after a clean stop, 1 when the
model could not be loaded, 2 for a bad config, a socket another edgekitd answers on, or a missing serve extra.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import logging
import signal
import sys
from collections.abc import AsyncIterator
from types import FrameType
from typing import TYPE_CHECKING, Any

from edgekit.errors import EdgekitError

from .config import DEFAULT_CONFIG_PATH, DaemonConfig, check_files, load_config, read_token

if TYPE_CHECKING:  # imported when serving, not for --help or --check-config
    import uvicorn
    from fastapi import FastAPI

    from .service import Daemon

log = logging.getLogger("edgekitd")

# What pyproject's `serve` extra installs, by the module names it provides (python-multipart renamed its module).
SERVE_MODULES = (
    ("fastapi",),
    ("uvicorn",),
    ("prometheus_client",),
    ("python_multipart", "multipart"),
    ("swagger_ui_bundle",),
)
SERVE_EXTRA_HINT = "pip install 'edgekit[serve]'"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="edgekitd", description="edgekit's on-device report daemon")
    p.add_argument("--config", "-c", help=f"TOML config file (default {DEFAULT_CONFIG_PATH} when it exists)")
    p.add_argument("--state-dir", help="jobs, built bundles (default /var/lib/edgekit)")
    p.add_argument("--socket", help="Unix socket path (default /run/edgekit/edgekitd.sock)")
    p.add_argument("--tcp", action=argparse.BooleanOptionalAction, default=None, help="also listen on TCP")
    p.add_argument("--tcp-host")
    p.add_argument("--tcp-port", type=int)
    p.add_argument("--tcp-token-file")
    p.add_argument("--default-model-dir", help="weights of the default model served when no variant is configured")
    p.add_argument("--workers", type=int)
    p.add_argument("--max-queue", type=int)
    p.add_argument("--ingest-processes", type=int, help="processes that decode studies (0: the daemon's own threads)")
    p.add_argument("--max-batch", type=int, help="reports decoding together per variant (1: one at a time)")
    p.add_argument("--batch-controller", choices=["fixed", "bandwidth", "latency"], dest="batch_controller")
    p.add_argument("--threads", type=int, help="ONNX Runtime threads per variant (default: half the physical cores)")
    p.add_argument("--drain-timeout", type=float, dest="drain_timeout_s")
    p.add_argument(
        "--keep-alive",
        type=float,
        dest="keep_alive_s",
        help="seconds before an idle non-active variant unloads (negative: never; default 300)",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--check-config", action="store_true", help="validate the config, print it, exit")
    p.add_argument(
        "--print-dicom-dropin",
        action="store_true",
        help="print the edgekitd.service drop-in that opens the network the config's DICOM settings need, exit",
    )
    return p.parse_args(argv)


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "state_dir": args.state_dir,
        "socket": args.socket,
        "tcp_enabled": args.tcp,
        "tcp_host": args.tcp_host,
        "tcp_port": args.tcp_port,
        "tcp_token_file": args.tcp_token_file,
        "default_model_dir": args.default_model_dir,
        "workers": args.workers,
        "max_queue": args.max_queue,
        "ingest_processes": args.ingest_processes,
        "max_batch": args.max_batch,
        "batch_controller": args.batch_controller,
        "threads": args.threads,
        "drain_timeout_s": args.drain_timeout_s,
        "log_level": args.log_level,
        "keep_alive_s": args.keep_alive_s,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = overrides_from(args)
    try:
        cfg = load_config(args.config, overrides)
        token = read_token(cfg)
    except EdgekitError as err:
        print(f"edgekitd: error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(), stream=sys.stderr, format="edgekitd[%(process)d] %(levelname)s %(message)s"
    )
    if args.check_config:
        from .intake import ingest_processes
        from .memory import cgroup_memory_max, check_memory

        try:
            check_files(cfg)
            check_memory(
                cfg.ingest_memory_bytes,
                cfg.max_upload_bytes,
                cgroup_memory_max(cfg.signals_root),
                ingest_processes(cfg),
            )
        except EdgekitError as err:
            print(f"edgekitd: error: {err}", file=sys.stderr)
            return 2
        print(cfg)
        return 0
    if args.print_dicom_dropin:
        from .unit_dropin import render

        try:
            print(render(cfg), end="")
        except EdgekitError as err:
            print(f"edgekitd: error: {err}", file=sys.stderr)
            return 2
        return 0
    missing = missing_serve_module()
    if missing is not None:
        print(
            f"edgekitd: error: serving needs edgekit's serve extra (module {missing} is missing): {SERVE_EXTRA_HINT}",
            file=sys.stderr,
        )
        return 2
    return serve(cfg, overrides, token)


def missing_serve_module() -> str | None:
    """The first module of the serve extra that cannot be imported (None: all there). Checked before serving so an
    install without the extra says what to install, not a traceback from deep inside the app."""
    for names in SERVE_MODULES:
        for name in names:
            try:
                importlib.import_module(name)
                break
            except ImportError:
                continue
        else:
            return names[0]
    return None


def serve(cfg: DaemonConfig, overrides: dict[str, Any], token: str | None) -> int:
    from . import logs
    from .api import create_app
    from .intake import ingest_processes
    from .listen import open_listeners
    from .memory import cgroup_memory_max, check_memory
    from .service import Daemon

    try:  # one budget against the unit's MemoryMax=: a config that cannot fit does not start
        check_memory(
            cfg.ingest_memory_bytes, cfg.max_upload_bytes, cgroup_memory_max(cfg.signals_root), ingest_processes(cfg)
        )
    except EdgekitError as err:
        log.error("%s", err)
        return 2
    quiet_onnxruntime()

    # The model worker gives the GIL up in every ONNX Runtime call and must win it back ~200 times a report; with
    # uploads parsed beside it, each wait can last the whole switch interval (default 5 ms). bench/daemon_load.py
    # saw generation p50 rise 138 -> 231 ms at concurrency 4 with 5 ms, and throughput at c=4/16 +10-15% with 1 ms
    # (on a busy shared 2-core machine: indicative, not settled).
    sys.setswitchinterval(0.001)
    try:  # the sockets first: a second daemon on a live socket is refused before it touches the state dir
        sockets, how = open_listeners(cfg)
    except EdgekitError as err:
        log.error("%s", err)
        return 2
    try:
        daemon = Daemon(cfg, overrides=overrides)
    except EdgekitError as err:
        log.error("%s", err)
        close_listeners(sockets, cfg, how)
        return 2
    app = create_app(daemon, token=token)
    server = http_server(app, daemon)
    logs.install()  # after uvicorn's Config has set up its own handlers
    app.router.lifespan_context = functools.partial(lifespan, daemon=daemon, server=server, how=how)
    for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn re-raises these after its shutdown: make that a no-op
        signal.signal(sig, lambda *_: None)
    server.run(sockets=sockets)
    close_listeners(sockets, cfg, how)
    return 1 if daemon.failed else 0


def close_listeners(sockets: list, cfg: DaemonConfig, how: str) -> None:
    """Close our sockets and remove the Unix socket file we bound (never one systemd passed)."""
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.close()
    if cfg.socket and not how.startswith("socket activation"):
        with contextlib.suppress(OSError):
            cfg.socket.unlink()


def http_server(app: FastAPI, daemon: Daemon) -> uvicorn.Server:
    """uvicorn, told to say STOPPING=1 and stop taking work at the first signal, not after connections drained."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            daemon.stop_accepting()
            super().handle_exit(sig, frame)

    cfg = daemon.cfg
    return Server(
        uvicorn.Config(
            app,
            lifespan="on",
            access_log=False,
            log_level=cfg.log_level,
            loop="asyncio",
            http="h11",
            timeout_graceful_shutdown=int(cfg.drain_timeout_s) or 1,
            limit_concurrency=cfg.max_connections,  # beyond it uvicorn answers 503 (the unit's LimitNOFILE=4096)
        )
    )


def quiet_onnxruntime() -> None:
    """ONNX Runtime's telemetry off before any session: the daemon reports nothing anywhere but its own log."""
    try:
        import onnxruntime

        onnxruntime.disable_telemetry_events()
    except (ImportError, AttributeError):  # a build without the call has no telemetry to stop
        pass


@contextlib.asynccontextmanager
async def lifespan(_app: FastAPI, *, daemon: Daemon, server: uvicorn.Server, how: str) -> AsyncIterator[None]:
    """Load in a thread while the sockets already answer (readiness says "loading"); SIGHUP reloads; the event
    loop's heartbeat feeds the watchdog; on the way out, drain."""
    loop = asyncio.get_running_loop()

    async def heartbeat() -> None:
        while True:
            daemon.beat()
            await asyncio.sleep(1.0)

    def started(fut: asyncio.Future[None]) -> None:
        if fut.exception() is not None:
            server.should_exit = True

    beat = loop.create_task(heartbeat())
    loop.run_in_executor(None, daemon.start).add_done_callback(started)
    loop.add_signal_handler(signal.SIGHUP, lambda: loop.run_in_executor(None, daemon.reload))
    log.info("listening on %s", how)
    try:
        yield
    finally:
        beat.cancel()
        await asyncio.to_thread(daemon.stop)


if __name__ == "__main__":
    sys.exit(main())
