"""Loading reads each tensor straight into its new memory: the peak is the loaded tensors plus one tensor, whatever
the shard sizes, also where per-expert tensors are stacked (docs/architecture.md §11.1)."""

import json
import subprocess
import sys
import textwrap

import torch
from safetensors.torch import save_file

from k3.checkpoint import load_checkpoint_state
from k3.checkpoint.io import checkpoint_bytes

TENSORS, ROWS, COLS = 8, 1024, 8192  # 8 experts of 32 MiB in fp32, 256 MiB in all, in two shards
STACKED = "model.layers.1.block_sparse_moe.experts.w1"


def _write_sharded(path):
    weight_map = {}
    for shard in range(2):
        experts = range(shard * TENSORS // 2, (shard + 1) * TENSORS // 2)
        file = f"model-0000{shard + 1}-of-00002.safetensors"
        tensors = {f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight": torch.full((ROWS, COLS), float(e))
                   for e in experts}
        save_file(tensors, path / file)
        weight_map.update(dict.fromkeys(tensors, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_peak_memory_is_the_loaded_tensors_plus_one(tmp_path):
    _write_sharded(tmp_path)
    assert checkpoint_bytes(tmp_path) == TENSORS * ROWS * COLS * 4
    script = textwrap.dedent(f"""
        import resource, torch
        from k3.checkpoint import load_checkpoint_state
        torch.empty(1)  # torch's own start-up memory counted before
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        stacked = load_checkpoint_state({str(tmp_path)!r}, {{{STACKED!r}: ({TENSORS}, {ROWS}, {COLS})}})[{STACKED!r}]
        assert all(bool((stacked[e] == e).all()) for e in range({TENSORS}))
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
    """)
    grown = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                               timeout=120).stdout)
    loaded, largest = TENSORS * ROWS * COLS * 4, ROWS * COLS * 4
    # (a memory-mapped file whose pages stay mapped while the stack is copied out of them adds up to `loaded`)
    assert grown <= loaded + largest + 32 * 2**20, grown


def test_progress_counts_every_byte_and_casts_go_through_one_temporary(tmp_path):
    save_file({"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)},
              tmp_path / "model.safetensors")
    seen = []
    state = load_checkpoint_state(tmp_path, {"a": (2, 3), "b": (4,)}, dtype=torch.float32, progress=seen.append)
    assert sorted(seen) == [8, 24] and sum(seen) == checkpoint_bytes(tmp_path)
    assert torch.equal(state["a"], torch.arange(6.0).view(2, 3)) and state["b"].dtype == torch.float32
