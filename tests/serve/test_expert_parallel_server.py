"""`torchrun --nproc_per_node 2 -m k3 serve CHECKPOINT --ep 2`: one endpoint on rank 0, half of the routed experts on
each rank; it answers what the single-process server answers, and SIGTERM to rank 0 finishes the stream under way
and stops every rank with exit 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

AUTH = {"Authorization": "Bearer sekret", "Content-Type": "application/json"}
PROMPT = "To be, or not to be, that is the question"
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")


def completion(server, prompt: str) -> dict:
    status, _, body = server.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 8,
                                                                  "temperature": 0, "logprobs": 1}, AUTH)
    assert status == 200, body
    return body["choices"][0]


def test_ep_server_answers_as_one_process(checkpoint, server, start_server):
    prompts = [PROMPT[: 4 + 5 * i] for i in range(6)]
    ep = start_server(checkpoint, "--api-key", "sekret", "--max-batch", "16", "--prefill-chunk", "32",
                      "--max-context", "1024", "--model-name", "tiny", "--ep", "2", launcher=TORCHRUN)
    try:
        alone = [completion(server, p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:  # batched decoding through the all-to-all too
            split = list(pool.map(lambda p: completion(ep, p), prompts))
        for a, b in zip(split, alone):
            assert a["text"] == b["text"]
            assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=1e-4)
        # SIGTERM to rank 0: the stream under way finishes, rank 1 is told to stop, torchrun sees both exit 0
        conn = ep.connect()
        conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 60, "temperature": 0,
                                                            "stream": True}), AUTH)
        response = conn.getresponse()
        assert response.readline().startswith(b"data: ")
        os.kill(rank_zero(ep.proc.pid), signal.SIGTERM)
        assert response.read().decode().rstrip().endswith("data: [DONE]")
        assert ep.proc.wait(timeout=90) == 0, ep.proc.stdout.read()
    finally:
        ep.kill()


def rank_zero(torchrun_pid: int) -> int:
    """The process of rank 0 among torchrun's workers (its children with RANK=0 in their environment)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if ppid == torchrun_pid and b"RANK=0" in environ:
            return int(stat.parent.name)
    raise AssertionError("torchrun's rank 0 was not found")


def test_ep_needs_torchrun_and_matching_processes(checkpoint):
    alone = subprocess.run([sys.executable, "-m", "k3", "serve", checkpoint, "--port", "0", "--ep", "2"],
                           capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2 and "--ep 2 needs a multi-process torchrun job" in alone.stderr
    assert "Traceback" not in alone.stderr
