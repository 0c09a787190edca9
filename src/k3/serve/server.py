"""`k3 serve`: load a checkpoint, start the engine, and run the HTTP app under uvicorn until SIGTERM or Ctrl-C.

On either signal uvicorn stops accepting connections and lets the requests under way finish for `grace_s` seconds
(longer ones are cancelled), then the engine stops and the process exits 0. With expert parallelism (`--ep N` under
torchrun) rank 0 does all of this and the other ranks only serve its MoE layers' experts
(`k3.parallel.expert_serving`); they stop when rank 0 does.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from k3.config import K3Config
from k3.inference.engine import Engine
from k3.model import K3ForCausalLM, K3ForConditionalGeneration
from k3.parallel.expert_serving import ExpertService
from k3.runtime import huge_page_weights
from k3.serve.app import ServerState, create_app
from k3.tokenizer import K3Tokenizer


@dataclass
class Loaded:
    """A checkpoint in memory: the model, its tokenizer and, for a vision checkpoint, its image processor."""

    model: K3ForCausalLM | K3ForConditionalGeneration
    tokenizer: K3Tokenizer
    processor: Any = None


def load(checkpoint: str, experts: str | None = None) -> Loaded:
    """The model, tokenizer (and image processor, for a vision checkpoint) of `checkpoint`."""
    if not os.path.isdir(checkpoint):
        raise ValueError(f"checkpoint directory {checkpoint!r} does not exist")
    tokenizer = K3Tokenizer.load(checkpoint)
    multimodal = K3Config.from_json(checkpoint).vision_config is not None
    model_class = K3ForConditionalGeneration if multimodal else K3ForCausalLM
    model = model_class.from_pretrained(checkpoint, experts=experts).eval()
    huge_page_weights(model)  # 2 MiB pages for the weights every decode step reads (k3.runtime), as k3 generate
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
                         f"{model.config.vocab_size}")
    processor = None
    if multimodal:
        from k3.vision.processor import K3Processor

        processor = K3Processor.load(checkpoint, tokenizer)
    return Loaded(model, tokenizer, processor)


def start_state(checkpoint: str, name: str, *, experts: str | None = None, ep_mesh: DeviceMesh | None = None,
                api_key: str | None = None, **engine_args) -> tuple[ServerState, ExpertService | None]:
    """Load `checkpoint` and run its engine, both in the engine's thread (`Engine.start_built`): the server's state,
    and this rank's part in expert parallelism over `ep_mesh` (whose idle beats keep the other ranks waiting)."""
    made: dict[str, Any] = {}

    def build() -> Engine:
        loaded = made["loaded"] = load(checkpoint, experts)
        service = made["service"] = None if ep_mesh is None else ExpertService(loaded.model, ep_mesh)
        return Engine(loaded.model, on_idle=None if service is None else service.idle,
                      vocab_size=loaded.tokenizer.vocab_size, **engine_args)
    engine = Engine.start_built(build)
    loaded = made["loaded"]
    return ServerState(engine, loaded.tokenizer, name, api_key=api_key, processor=loaded.processor), made["service"]


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so that a taken port fails at once (port 0: any free one)."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def run(state: ServerState, sock: socket.socket, grace_s: float, experts: ExpertService | None = None) -> int:
    import uvicorn

    app = create_app(state)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, timeout_graceful_shutdown=grace_s, log_level="warning",
                                           access_log=False, lifespan="off"))
    # uvicorn re-raises the signal that stopped it once it has shut down; a no-op handler lets us exit 0 after a
    # graceful stop instead of dying by the signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    print(f"k3 serve: {state.model_name} on http://{host}:{port} (max batch {state.engine.max_batch}, context "
          f"{state.engine.max_context})", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        state.engine.shutdown(grace_s=0)
        sock.close()
        if experts is not None:  # the engine thread has ended: no model call can follow
            experts.stop()
    return 0


def follow(experts: ExpertService) -> int:
    """An expert rank: serve rank 0's MoE layers until it stops. SIGTERM and Ctrl-C reach every rank of a torchrun
    job; this rank ignores them and ends when rank 0, having finished its requests, says so."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    experts.follow()
    return 0
