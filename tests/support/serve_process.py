"""`dpa serve` as a process of its own on 127.0.0.1, for the serving tests."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """A running `dpa serve`: `url`, `process`; after the block, `returncode` and `log` (stderr)."""

    def __init__(self, url: str, process: subprocess.Popen):
        self.url, self.process = url, process
        self.returncode, self.log = None, ""


@contextlib.contextmanager
def dpa_serve(*args: str) -> Iterator[ServeProcess]:
    """`dpa serve ARGS --port <free>` on 127.0.0.1; on leaving the block, SIGTERM and up to 60 s
    to exit (killed after that, or where the block raised), its exit status and log kept."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "diffusion_policy_accelerated.cli", "serve", *args,
                                "--port", str(port)], stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    served = ServeProcess(f"http://127.0.0.1:{port}", process)
    try:
        yield served
        process.send_signal(signal.SIGTERM)
        served.returncode = process.wait(timeout=60)
        served.log = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
