"""A real ``mooncake_master`` for tests: free 127.0.0.1 ports, embedded HTTP metadata server.

Used by the storage tests' fixtures (and the storage benchmark). ``stop()`` kills it;
``start()`` again brings it back on the same ports (the fault tests do that).
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from engine.storage.config import MooncakeStoreConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary() -> str | None:
    exe = Path(sys.executable).parent / "mooncake_master"
    return str(exe) if exe.exists() else shutil.which("mooncake_master")


def _die_with_parent() -> None:
    """In the child: SIGKILL when the test process goes away, however it goes (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


class MooncakeMaster:
    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.log_path = self.workdir / "mooncake_master.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0) -> "MooncakeMaster":
        exe = master_binary()
        if exe is None:
            raise RuntimeError("mooncake_master not found (pip install mooncake-transfer-engine"
                               "-non-cuda into this environment)")
        cmd = [exe, "-rpc_address=127.0.0.1", f"-rpc_port={self.rpc_port}",
               "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
               f"-http_metadata_server_port={self.http_port}",
               "-metrics_host=127.0.0.1", f"-metrics_port={self.metrics_port}",
               "-logtostderr=true", "-rpc_thread_num=2"]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=self.workdir,
                                     preexec_fn=_die_with_parent)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not (_listening(self.rpc_port) and _listening(self.http_port)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"mooncake_master did not come up:\n{tail}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def config(self, **kw) -> MooncakeStoreConfig:
        base = dict(master_server_address=f"127.0.0.1:{self.rpc_port}",
                    metadata_server=f"http://127.0.0.1:{self.http_port}/metadata",
                    local_hostname="127.0.0.1", global_segment_size=128 << 20,
                    local_buffer_size=64 << 20, staging_bytes=8 << 20)
        base.update(kw)
        return MooncakeStoreConfig(**base)

    def config_dict(self) -> dict:
        """The same settings in Mooncake's own config-file format."""
        return {"local_hostname": "127.0.0.1",
                "metadata_server": f"http://127.0.0.1:{self.http_port}/metadata",
                "master_server_address": f"127.0.0.1:{self.rpc_port}",
                "global_segment_size": "128mb", "local_buffer_size": "64mb",
                "protocol": "tcp", "device_name": ""}

