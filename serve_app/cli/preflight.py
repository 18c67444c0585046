"""What `rayllm serve` checks before it starts Ray, so that a mistake fails in seconds with one line
naming it (CliError) instead of a Ray traceback or a replica that never starts."""
from __future__ import annotations

import errno
import socket
from typing import Any


class CliError(Exception):
    """A problem the user can fix; `rayllm` prints `error: <message>` and exits 2."""


def check_app_args(args: dict[str, Any]):
    """AppArgs validated, relative paths made absolute and the checkpoint checked (exists, a supported
    architecture): what build_app will do, here before Ray starts."""
    from serve_app.args import resolve_app_args

    try:
        return resolve_app_args(args)
    except ValueError as e:
        raise CliError(str(e).removeprefix("invalid application args: ")) from None


def check_port_free(host: str, port: int) -> None:
    """Refuse a port something already listens on. Serve's proxies (HAProxy and the Python one)
    bind with SO_REUSEPORT, so a second app on a served port would start and silently share it:
    bind it here without SO_REUSEPORT (SO_REUSEADDR only lets TIME_WAIT connections of an earlier
    server pass), and for a wildcard host, connect to it on loopback too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise CliError(f"port {port} on {host} is in use (another server, maybe another rayllm serve); "
                               "pick another with --port") from None
            raise CliError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    probe = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        if s.connect_ex((probe, port)) == 0:
            raise CliError(f"port {port} on {probe} is in use (another server answers there); pick another with --port")


def check_device(device: str) -> None:
    """device=cuda needs a GPU on this machine: without one the replica would wait forever for a
    GPU bundle, printing scheduling warnings."""
    if device == "cuda" and not has_gpu():
        raise CliError("device=cuda but this machine has no CUDA GPU (torch.cuda.is_available() is False); "
                       "use --device cpu or auto")


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()
