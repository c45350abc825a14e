"""A Mooncake master for development and tests, on loopback, inside a private network namespace.

``start_master()`` runs ``mooncake_master`` bound to 127.0.0.1 with its HTTP metadata server off and
its metrics server on loopback, waits until ``/health`` answers, and returns a handle that stops it.
``main(argv)`` backs ``kvflow mooncake-master``: it runs one in the foreground until interrupted.

Mooncake clients listen on every interface whatever they are told, so this module refuses to start
anything unless the process is in a network namespace whose only interface is ``lo``. Run as root::

    unshare -n bash -c 'ip link set lo up; export MC_TCP_BIND_ADDRESS=127.0.0.1; kvflow mooncake-master'

Everything here is synchronous (subprocesses and a blocking HTTP check); call it from a plain
thread or before an event loop starts, never from inside a coroutine.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import importlib.util
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import attrs

from kvflow.errors import BackendError, BackendUnavailableError

__all__ = [
    "MasterProcess",
    "NotIsolatedError",
    "SegmentHolder",
    "check_private_netns",
    "find_master_binary",
    "find_mooncake_binary",
    "free_port",
    "listening_ports",
    "loopback_up",
    "main",
    "network_interfaces",
    "start_master",
    "start_segment_holder",
]

LOOPBACK = "127.0.0.1"
_SIOCGIFFLAGS = 0x8913
_IFF_UP = 0x1
_PR_SET_PDEATHSIG = 1

_ISOLATE_HINT = (
    "Run it as root inside a private network namespace that has only loopback:\n"
    "  unshare -n bash -c 'ip link set lo up; export MC_TCP_BIND_ADDRESS=127.0.0.1; <your command>'"
)


class NotIsolatedError(BackendError):
    """This process is not in a private network namespace with only a working loopback."""


def network_interfaces() -> list[str]:
    """Names of the interfaces of this process's network namespace.

    From ``socket.if_nameindex()`` (netlink, per namespace). ``/sys/class/net`` is not used: it
    shows the namespace that mounted sysfs, so after a bare ``unshare -n`` it still lists the host's.
    """
    return sorted(name for _, name in socket.if_nameindex())


def loopback_up() -> bool:
    """Whether ``lo`` is up in this namespace (``SIOCGIFFLAGS``; sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh22x", b"lo", 0)
        try:
            answer = fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, request)
        except OSError:
            return False
    flags: int = struct.unpack("16sh", answer[:18])[1]
    return bool(flags & _IFF_UP)


def check_private_netns() -> None:
    """Raise NotIsolatedError unless the only network interface is ``lo`` and it is up."""
    interfaces = network_interfaces()
    if interfaces != ["lo"]:
        raise NotIsolatedError(
            f"refusing to start Mooncake: this process sees network interfaces {interfaces}, and "
            f"Mooncake listens on all of them. {_ISOLATE_HINT}"
        )
    if not loopback_up():
        raise NotIsolatedError("loopback is down in this network namespace: run `ip link set lo up` first")


def find_master_binary() -> Path:
    """``mooncake_master`` from the installed ``mooncake`` package, else from PATH."""
    return find_mooncake_binary("mooncake_master")


def find_mooncake_binary(name: str) -> Path:
    """Mooncake's program ``name`` (``mooncake_master``, ``mooncake_client``) from the installed
    ``mooncake`` package, else from this Python's ``bin``, else from PATH."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(folder) / name
        if candidate.is_file():
            if not os.access(candidate, os.X_OK):
                candidate.chmod(candidate.stat().st_mode | 0o111)
            return candidate
    for candidate_dir in (Path(sys.prefix) / "bin",):
        candidate = candidate_dir / name
        if candidate.is_file():
            return candidate
    found = shutil.which(name)
    if found is None:
        raise BackendError(
            f"{name} was not found; install it with: pip install 'kvflow[mooncake]' "
            "(package mooncake-transfer-engine-non-cuda, which needs Debian's libibverbs1 ibverbs-providers)"
        )
    return Path(found)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def listening_ports(pid: int) -> set[int] | None:
    """The TCP ports process ``pid`` listens on in this network namespace (from /proc: its socket
    inodes, matched in /proc/net/tcp and tcp6); None where /proc/net has no TCP table."""
    inodes: set[str] = set()
    with contextlib.suppress(OSError):  # (the process has exited: no sockets)
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # (closed meanwhile)
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    ports: set[int] | None = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        ports = ports or set()
        for row in rows:  # sl local_address rem_address st ... inode: st 0A is LISTEN
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:
                ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the thread that started us exits."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_P = TypeVar("_P", bound="OwnedProcess")


@attrs.define
class OwnedProcess:
    """A child process this object owns: :meth:`stop` or ``with`` ends it."""

    process: subprocess.Popen[bytes]

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                return self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


@attrs.define
class MasterProcess(OwnedProcess):
    """A running ``mooncake_master``. Owns the process: :meth:`stop` or ``with`` ends it."""

    rpc_port: int
    metrics_port: int
    log_path: Path | None = None

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    def url(self, **params: str | int | float) -> str:
        """A ``mooncake://`` backend URL for this master, with query parameters."""
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"mooncake://{self.address}" + (f"?{query}" if query else "")

    def alive(self) -> bool:
        return self.process.poll() is None

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """Whether ``/health`` on the metrics port answers 200 (loopback only)."""
        try:
            url = f"http://{LOOPBACK}:{self.metrics_port}/health"
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until ready: ``/health`` answers 200 and this process itself listens on both its
        ports (another master holding one of them answers ``/health`` too, while this one exits).
        Raise BackendUnavailableError, with its exit code and log tail, if it exits or takes too long."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise BackendUnavailableError(
                    f"mooncake_master exited with code {self.process.returncode} while starting "
                    f"(is port {self.rpc_port} or {self.metrics_port} in use by another process?)"
                    + self._log_hint()
                )
            if self.owns_ports() and self.healthy(timeout_s=0.5):
                return
            time.sleep(0.05)
        raise BackendUnavailableError(
            f"mooncake_master on {self.address} not ready after {timeout_s:g} s (ready: /health "
            f"answers on port {self.metrics_port} and the master itself listens on ports "
            f"{self.rpc_port} and {self.metrics_port})" + self._log_hint()
        )

    def owns_ports(self) -> bool:
        """Whether this process listens on its RPC and metrics ports (True where /proc cannot tell)."""
        ports = listening_ports(self.process.pid)
        return ports is None or {self.rpc_port, self.metrics_port} <= ports

    def kill(self) -> None:
        """SIGKILL now, as a crash would (for failure tests)."""
        if self.alive():
            self.process.kill()
        self.process.wait()

    def _log_hint(self) -> str:
        if self.log_path is None:
            return "; start it with log_path= to keep its output"
        if not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-10:]
        return f"; last lines of {self.log_path}:\n" + "\n".join(tail)


@attrs.define
class SegmentHolder(OwnedProcess):
    """A running ``mooncake_client`` that only lends a segment to the cluster (no puts or gets of
    its own), as a storage node does. :meth:`stop` or ``with`` ends it; its objects go with it."""


def start_segment_holder(master: str, *, segment: str = "2GB", mount_s: float = 2.0) -> SegmentHolder:
    """Start a ``mooncake_client`` on 127.0.0.1 that lends ``segment`` bytes to the master at
    ``master`` (``host:port``), and give it ``mount_s`` to mount them. Clients with ``segment=0``
    then put every object into it, across processes, as they would into a storage node's.

    Refuses (NotIsolatedError) outside a private network namespace; BackendUnavailableError if
    the holder exits while mounting.
    """
    check_private_netns()
    process = subprocess.Popen(
        [
            os.fspath(find_mooncake_binary("mooncake_client")),
            f"--host={LOOPBACK}",
            "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp",
            f"--global_segment_size={segment}",
            f"--master_server_address={master}",
            f"--port={free_port()}",  # (its default, 50052, would clash with a second holder's)
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )
    time.sleep(mount_s)
    if process.poll() is not None:
        raise BackendUnavailableError(f"mooncake_client exited with code {process.returncode} while mounting")
    return SegmentHolder(process)


def master_args(rpc_port: int, metrics_port: int, extra: Sequence[str] = ()) -> list[str]:
    """The flags that keep a master on loopback with no HTTP metadata server."""
    return [
        f"--rpc_address={LOOPBACK}",
        f"--rpc_port={rpc_port}",
        "--enable_http_metadata_server=false",
        f"--http_metadata_server_host={LOOPBACK}",
        f"--metrics_host={LOOPBACK}",
        f"--metrics_port={metrics_port}",
        *extra,
    ]


def start_master(
    *,
    rpc_port: int = 50051,
    metrics_port: int = 9003,
    extra_args: Sequence[str] = (),
    log_path: Path | None = None,
    ready_timeout_s: float = 15.0,
    binary: Path | None = None,
    die_with_parent: bool = True,
) -> MasterProcess:
    """Start ``mooncake_master`` on 127.0.0.1 and wait until it is ready
    (:meth:`MasterProcess.wait_healthy`).

    Refuses (NotIsolatedError) outside a private network namespace; BackendUnavailableError, with
    the exit code and the tail of ``log_path``, when the master exits first (a port in use).
    ``die_with_parent`` asks Linux to SIGTERM the master when the starting thread exits (start it
    from a long-lived thread).
    """
    check_private_netns()
    exe = binary or find_master_binary()
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log_path, "ab")) if log_path is not None else subprocess.DEVNULL
        process = subprocess.Popen(
            [os.fspath(exe), *master_args(rpc_port, metrics_port, extra_args)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
    master = MasterProcess(process, rpc_port, metrics_port, log_path)
    try:
        master.wait_healthy(ready_timeout_s)
    except BaseException:
        master.stop(timeout_s=2.0)
        raise
    return master


def main(argv: list[str]) -> int:
    """``kvflow mooncake-master [--port N] [--metrics-port N] [-- MASTER FLAGS...]``."""
    parser = argparse.ArgumentParser(
        prog="kvflow mooncake-master",
        description="Run a Mooncake master on 127.0.0.1 for development (private network namespace only).",
    )
    parser.add_argument("--port", type=int, default=50051, help="RPC port (default 50051)")
    parser.add_argument("--metrics-port", type=int, default=9003, help="metrics/health port (default 9003)")
    parser.add_argument("--log", type=Path, default=None, help="append the master's output to this file")
    parser.add_argument("extra", nargs="*", help="more mooncake_master flags, after --")
    args = parser.parse_args(argv)
    try:
        master = start_master(
            rpc_port=args.port, metrics_port=args.metrics_port, extra_args=args.extra, log_path=args.log
        )
    except BackendError as exc:
        print(f"kvflow mooncake-master: {exc}", file=sys.stderr)
        return 2
    print(f"Mooncake master on {master.address} (health: http://{LOOPBACK}:{args.metrics_port}/health)")
    print(f"backend URL: {master.url()}", flush=True)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return master.process.wait()
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        master.stop()
        signal.signal(signal.SIGTERM, previous)
