"""`from_pretrained` / `save_pretrained` in the released checkpoint layout, for the text and the multimodal model
(docs/architecture.md §11).

The module trees differ only by where the text model sits: at the root of `K3ForCausalLM`, under
`language_model.` in `K3ForConditionalGeneration`. The checkpoint layer (`k3.checkpoint`) sees text tensors
without that module prefix and adds the file's own prefix (`language_model.` in a multimodal file).
"""

from __future__ import annotations

import os

import torch
from tqdm import tqdm

from k3.checkpoint import load_checkpoint_state, save_checkpoint_state
from k3.checkpoint.io import DEFAULT_MAX_SHARD_SIZE, checkpoint_bytes
from k3.checkpoint.hf import LANGUAGE_MODEL_PREFIX, NON_TEXT_PREFIXES, convert_experts
from k3.checkpoint.quantization import experts_format, with_experts_format
from k3.config import K3Config
from k3.ops.precision import is_fp32_tensor


class PretrainedMixin:
    """Checkpoint I/O of a K3 model class whose text model sits under `text_module_prefix`."""

    text_module_prefix = ""  # "language_model." for the multimodal model
    config: K3Config

    def official_state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict with text tensors named without the module prefix (vision names unchanged)."""
        return {name.removeprefix(self.text_module_prefix): t for name, t in self.state_dict().items()}

    def _module_name(self, name: str) -> str:
        return name if name.startswith(NON_TEXT_PREFIXES) else self.text_module_prefix + name

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | None = None, experts: str | None = None,
                        progress: bool = False):
        """Load a directory in the released layout (§11): `config.json` + safetensors (sharded or not).

        `dtype=None` uses the stored dtype of `embed_tokens`; floating tensors are cast to `dtype`, except the
        fp32 set of §0.4, which is always fp32. Routed experts keep the form the checkpoint stores them in
        (`experts=None`: MXFP4 stays packed, §11.5), or take the one asked for: "dense" decodes MXFP4 experts (to
        `dtype`, else bf16, exactly), "mxfp4" encodes dense ones. A text model reads the text part of a multimodal
        checkpoint (vision tensors are skipped). `progress`: a progress bar of the bytes read, on a terminal.
        """
        config = K3Config.from_json(path)
        if experts is not None:
            config = with_experts_format(config, experts)
        with torch.device("meta"):
            model = cls(config)
        with tqdm(total=checkpoint_bytes(path) if progress else 0, unit="B", unit_scale=True, desc="loading",
                  disable=None if progress else True, leave=False) as bar:
            state = load_checkpoint_state(path, model.official_state_dict(), dtype=dtype, progress=bar.update)
        if dtype is None:  # one activation dtype: the embedding's stored one (MXFP4 experts decode to bf16)
            dtype = state["model.embed_tokens.weight"].dtype
            state = {n: t.to(dtype) if t.is_floating_point() and not is_fp32_tensor(n) else t
                     for n, t in state.items()}
        model.load_state_dict({model._module_name(n): t for n, t in state.items()}, strict=True, assign=True)
        return model

    def save_pretrained(self, path: str | os.PathLike, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                        experts: str | None = None) -> None:
        """Write `config.json` + safetensors in the official names and the released layout: the multimodal top
        level (a text-only model's without `vision_config`, `K3Config.released_layout`) and the text tensors
        prefixed `language_model.`. Routed experts are written in the model's own form (`experts=None`) or in the
        one asked for: "mxfp4" as the release stores them (packed pairs, its `quantization_config`), "dense"."""
        experts = experts or experts_format(self.config)
        config = with_experts_format(self.config.released_layout(), experts)
        os.makedirs(path, exist_ok=True)
        prefix = "" if config.multimodal is None else LANGUAGE_MODEL_PREFIX
        state = convert_experts(self.official_state_dict(), experts)
        save_checkpoint_state(path, state, config.kda_num_heads, max_shard_size=max_shard_size, prefix=prefix)
        config.save(path)
