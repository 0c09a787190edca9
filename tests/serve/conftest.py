"""A real `k3 serve` process on 127.0.0.1 and a free port, over a random k3-tiny checkpoint, with hard timeouts."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
START_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`k3 serve checkpoint *args` on a free port (`launcher`: what runs `-m k3` instead of plain Python, e.g.
    torchrun's module and its options)."""

    def __init__(self, checkpoint: str, *args: str, launcher: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "K3_API_KEY": ""}
        self.proc = subprocess.Popen([sys.executable, *launcher, "-m", "k3", "serve", checkpoint, "--port",
                                      str(self.port), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"k3 serve exited {self.proc.returncode}: {self.proc.stdout.read()}")
            try:
                if self.request("GET", "/health", timeout=1)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.kill()
        pytest.fail(f"k3 serve did not answer /health within {START_TIMEOUT_S} s")

    def connect(self, timeout: float = 60) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, body=None, headers=None, timeout: float = 60):
        """(status, headers, parsed JSON or text) of one raw HTTP request; `body` a dict (sent as JSON) or bytes."""
        conn = self.connect(timeout)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            conn.request(method, path, body=data, headers=headers or {})
            response = conn.getresponse()
            raw = response.read().decode()
            try:
                parsed = json.loads(raw)
            except json.JSONDecodeError:
                parsed = raw
            return response.status, dict(response.getheaders()), parsed
        finally:
            conn.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("serve") / "tiny")
    subprocess.run([sys.executable, "-m", "k3", "init", path, "--preset", "k3-tiny", "--dtype", "float32",
                    "--experts", "dense", "--seed", "0"], check=True, capture_output=True, timeout=120)
    return path


@pytest.fixture(scope="session")
def start_server():
    """Factory: `start_server(checkpoint, *args)` is a running `k3 serve` (kill it when done)."""
    return Server


@pytest.fixture(scope="session")
def server(checkpoint):
    """The main server: a key, 16 rows, a small prefill chunk (so the prefix cache works on short prompts)."""
    s = Server(checkpoint, "--api-key", "sekret", "--max-batch", "16", "--prefill-chunk", "32",
               "--max-context", "1024", "--model-name", "tiny")
    yield s
    s.kill()


@pytest.fixture(scope="session")
def vl_checkpoint(tmp_path_factory) -> str:
    """A random k3-tiny-vl checkpoint with the shapes task's tokenizer and an image processor config."""
    import torch

    from k3.config import K3Config
    from k3.model import K3ForConditionalGeneration
    from k3.train.tasks import shapes_tokenizer
    from k3.vision.processor import K3Processor

    path = tmp_path_factory.mktemp("serve_vl")
    config = K3Config.from_preset("k3-tiny-vl")
    torch.manual_seed(0)
    K3ForConditionalGeneration(config).save_pretrained(path)
    K3Processor(shapes_tokenizer(config.vocab_size)).save(path)
    return str(path)
