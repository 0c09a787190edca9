"""Expert-parallel serving (`k3.parallel.expert_serving`) on 2 gloo ranks: rank 0's batching engine, its routed
experts split over both ranks, gives the tokens and log-probabilities of one process; rank 1 serves exactly the MoE
layer calls rank 0 makes, waits through idle beats, and returns when rank 0 stops."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dist_utils import run_ranks

TIMEOUT_S = 120.0
LAYERS = 5  # k3-tiny cut to [KDA, KDA, KDA, MLA] + MLA: 4 MoE layers
PROMPTS = [[5, 17, 300, 41, 9, 77, 1000], [3, 3, 8], [250, 12, 600, 7, 7, 90, 14, 2000, 31, 64, 5]]
MAX_TOKENS = 4


def build():
    from k3.config import K3Config, k3_full_attn_layers
    from k3.model import K3ForCausalLM

    mla = k3_full_attn_layers(LAYERS)
    config = K3Config.from_preset("k3-tiny", num_hidden_layers=LAYERS, full_attn_layers=mla,
                                  kda_layers=[i for i in range(1, LAYERS + 1) if i not in mla])
    torch.manual_seed(0)
    return K3ForCausalLM(config).double().eval()


def serve(model, **engine_args):
    """Every prompt through one engine at once: (tokens, log-probabilities) per prompt."""
    from k3.inference.engine import Engine, SamplingParams

    engine = Engine(model, max_batch=4, prefill_chunk=4, prefix_cache_bytes=0, **engine_args).start()
    time.sleep(0.3)  # idle a while first (several beats where there is an `on_idle`)
    results = [([], []) for _ in PROMPTS]
    done = [threading.Event() for _ in PROMPTS]

    def emit(i):
        def on(event):
            if event.token_id is not None:
                results[i][0].append(event.token_id)
                results[i][1].append(event.logprob.logprob)
            if event.finish_reason is not None:
                done[i].set()
        return on
    for i, prompt in enumerate(PROMPTS):
        engine.submit(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0), emit(i))
    assert all(d.wait(TIMEOUT_S) for d in done)
    engine.shutdown(grace_s=0)
    assert engine.error is None
    return results


def ep_rank(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from k3.parallel.expert_serving import ExpertService

    model = build()
    alone = serve(model) if rank == 0 else None  # the single-process reference, before the experts are split
    service = ExpertService(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)))
    assert model.model.layers[1].block_sparse_moe.experts.w1.to_local().shape[0] == 16 // world_size
    if rank != 0:
        return {"served": service.follow()}
    calls = []
    for layer in service.layers:
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
    beats = []
    split = serve(model, on_idle=lambda: (beats.append(1), service.idle()), idle_s=0.05)
    service.stop()
    return {"alone": alone, "split": split, "calls": len(calls), "beats": len(beats)}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(ep_rank, 2, timeout=TIMEOUT_S, collective_timeout=60.0)


def test_split_experts_serve_what_one_process_does(ranks):
    leader = ranks[0]
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(leader["split"], leader["alone"]):
        assert tokens == ref_tokens and len(tokens) == MAX_TOKENS
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), rtol=0, atol=1e-10)


def test_the_follower_serves_every_moe_call_and_waits_through_idle_beats(ranks):
    leader, follower = ranks
    assert follower["served"] == leader["calls"] > 0
    assert leader["beats"] >= 1  # the engine's idle beat ran while the follower waited (and it kept waiting)
