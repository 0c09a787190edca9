"""Checkpoint loading and saving in the official Hugging Face layout (docs/architecture.md §11).

* ``load_checkpoint_state`` / ``save_checkpoint_state``: safetensors directories (single file or sharded).
* ``to_hf_state_dict`` / ``from_hf_state_dict``: name and shape translation, internal <-> official.
* ``decode_mxfp4`` / ``encode_mxfp4``: the MXFP4 format of the routed experts (§11.5).
"""

from k3.checkpoint.hf import CheckpointError, from_hf_state_dict, is_fp32_tensor, to_hf_state_dict
from k3.checkpoint.io import load_checkpoint_state, save_checkpoint_state
from k3.ops.mxfp4 import decode_mxfp4, encode_mxfp4

__all__ = [
    "CheckpointError",
    "decode_mxfp4",
    "encode_mxfp4",
    "from_hf_state_dict",
    "is_fp32_tensor",
    "load_checkpoint_state",
    "save_checkpoint_state",
    "to_hf_state_dict",
]
