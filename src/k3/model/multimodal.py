"""Multimodal K3: MoonViT-V2 + merger + projector feeding the text backbone (§9.1, §9.9, §11).

`input_ids` hold ONE `<|media_pad|>` placeholder per media item; the model expands each to that item's
(h/2)(w/2) projected features (per-position occupancy 1 for text, n_item for a placeholder; new position =
cumsum − 1) and runs the merged sequence through the text backbone. Rows whose merged lengths differ are padded on
the left (zero embeddings, attention mask 0), so every row still ends with its last real token.

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.model.cache import K3Cache
from k3.model.k3 import CausalLMOutput, K3ForCausalLM
from k3.model.pretrained import PretrainedMixin
from k3.ops.loss import IGNORE_INDEX
from k3.vision import MoonViT, PatchMergerProjector, merge_patches


def _token_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """[B, T] long mask per input token: 1 real, 0 padding (all real without an attention mask)."""
    return torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device).long()


class MergeLayout:
    """Placement of a batch in the merged sequence (§9.9): occupancy 1 per text token and n_item per
    placeholder, merged position = cumsum − 1, rows of different merged length padded on the left so every row
    ends at S − 1. Item i's feature rows fill the positions just before and at its placeholder's slot."""

    def __init__(self, is_media_BT: torch.Tensor, counts_I: torch.Tensor):
        self.is_media_BT, self.counts_I = is_media_BT, counts_I
        occupancy_BT = torch.ones_like(is_media_BT, dtype=torch.long)
        occupancy_BT[is_media_BT] = counts_I  # placeholders in row-major order = item order
        end_BT = occupancy_BT.cumsum(dim=1)
        self.length = int(end_BT[:, -1].max())
        self.pos_BT = end_BT - 1 + (self.length - end_BT[:, -1:])
        B, T = is_media_BT.shape
        self.rows_BT = torch.arange(B, device=is_media_BT.device)[:, None].expand(B, T)
        last_I = self.pos_BT[is_media_BT]
        offsets_M = torch.arange(int(counts_I.sum()), device=counts_I.device) \
            - (counts_I.cumsum(0) - counts_I).repeat_interleave(counts_I)
        self.media_rows_M = self.rows_BT[is_media_BT].repeat_interleave(counts_I)
        self.media_pos_M = (last_I - counts_I + 1).repeat_interleave(counts_I) + offsets_M

    def expand(self, values_BT: torch.Tensor, fill, media=None) -> torch.Tensor:
        """[B, T, ...] per input token → [B, S, ...]: text tokens at their positions, `fill` in the left
        padding, and at the feature rows `media` ([M, ...] rows or a scalar), by default the placeholder's value."""
        B = values_BT.shape[0]
        out = values_BT.new_full((B, self.length, *values_BT.shape[2:]), fill)
        text_BT = ~self.is_media_BT
        out[self.rows_BT[text_BT], self.pos_BT[text_BT]] = values_BT[text_BT]
        if self.counts_I.numel():
            if media is None:
                media = values_BT[self.is_media_BT].repeat_interleave(self.counts_I, dim=0)
            out[self.media_rows_M, self.media_pos_M] = media if not torch.is_tensor(media) else media.to(out.dtype)
        return out


class K3ForConditionalGeneration(PretrainedMixin, nn.Module):
    """The released `KimiK3ForConditionalGeneration`: modules `language_model`, `vision_tower`, `mm_projector`."""

    text_module_prefix = "language_model."

    def __init__(self, config: K3Config):
        super().__init__()
        vision = config.vision_config
        if vision is None:
            raise ValueError("K3ForConditionalGeneration needs a multimodal config with a vision_config "
                             "(use K3ForCausalLM for a text-only model)")
        media = config.media_placeholder_token_id
        if not isinstance(media, int) or not 0 <= media < config.vocab_size:
            raise ValueError(f"config media_placeholder_token_id={media!r} must be a token id in "
                             f"0..{config.vocab_size - 1}")
        self.config, self.vision_config = config, vision
        self.media_placeholder_token_id = media
        self.language_model = K3ForCausalLM(config)
        self.vision_tower = MoonViT(vision)
        self.mm_projector = PatchMergerProjector(vision)  # both initialised as in §9.11

    # ------------------------------------------------------------------------------------------- media
    def encode_media(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> list[torch.Tensor]:
        """Projected features of each media item, [(h/2)(w/2), C] per item, in `grid_thws` order (§9.1)."""
        patches_ND = self.vision_tower(pixel_values, grid_thws)  # validates pixel_values and grid_thws
        grids = [tuple(g) for g in torch.as_tensor(grid_thws).tolist()]
        features_MD = self.mm_projector(merge_patches(patches_ND, grids))
        return list(features_MD.split([(h // 2) * (w // 2) for _, h, w in grids]))

    def layout(self, input_ids: torch.LongTensor, grid_thws: torch.Tensor | None) -> MergeLayout:
        """Where every input token and media feature row lands in the merged sequence (§9.9)."""
        grids = [] if grid_thws is None else torch.as_tensor(grid_thws).tolist()
        counts_I = torch.tensor([(h // 2) * (w // 2) for _, h, w in grids], dtype=torch.long,
                                device=input_ids.device)
        return MergeLayout(input_ids == self.media_placeholder_token_id, counts_I)

    def merged_attention_mask(self, input_ids: torch.LongTensor, grid_thws: torch.Tensor | None,
                              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S] 1 at the real positions of the merged sequence `forward` builds (for token statistics)."""
        mask_BT = _token_mask(input_ids, attention_mask)
        return self.layout(input_ids, grid_thws).expand(mask_BT, fill=0)

    def merge_inputs(self, input_ids: torch.LongTensor, features: list[torch.Tensor], layout: MergeLayout,
                     labels: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.LongTensor | None, torch.Tensor | None]:
        """Scatter text embeddings and media features into [B, S, C] (§9.9).

        Returns (inputs_embeds, labels, attention_mask) in merged positions: labels are −100 at media features,
        padding and added left padding; the mask is None only when no row has padding.
        """
        mask_BT = _token_mask(input_ids, attention_mask)
        text_embeds_BTD = self.language_model.model.embed_tokens(input_ids.masked_fill(layout.is_media_BT, 0))
        dtype = features[0].dtype if features else text_embeds_BTD.dtype  # text cast to the projector's dtype
        text_embeds_BTD = text_embeds_BTD.to(dtype) * mask_BT[..., None].to(dtype)  # padding embeddings zeroed
        embeds_BrD = layout.expand(text_embeds_BTD, fill=0, media=torch.cat(features) if features else None)
        merged_labels = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape "
                                 f"{tuple(input_ids.shape)}")
            merged_labels = layout.expand(labels.masked_fill(mask_BT == 0, IGNORE_INDEX), fill=IGNORE_INDEX,
                                          media=IGNORE_INDEX)
        merged_mask_Br = layout.expand(mask_BT, fill=0)
        return embeds_BrD, merged_labels, merged_mask_Br if bool((merged_mask_Br == 0).any()) else None

    def _check_media(self, input_ids: torch.Tensor, pixel_values, grid_thws) -> None:
        placeholders = int((input_ids == self.media_placeholder_token_id).sum())
        items = 0 if grid_thws is None else int(torch.as_tensor(grid_thws).reshape(-1, 3).shape[0])
        if (pixel_values is None) != (grid_thws is None):
            raise ValueError("pixel_values and grid_thws must be given together")
        if placeholders != items:
            raise ValueError(f"input_ids hold {placeholders} media placeholders (<|media_pad|> = "
                             f"{self.media_placeholder_token_id}) but {items} media items were given (grid_thws); "
                             "there must be exactly one placeholder per item")

    # ------------------------------------------------------------------------------------------- model
    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        self.language_model.check_input_ids(input_ids)

    def make_cache(self, batch_size: int, capacity: int = 256, cache_dtype: torch.dtype | None = None) -> K3Cache:
        return self.language_model.make_cache(batch_size, capacity, cache_dtype)

    def forward(self, input_ids: torch.LongTensor, pixel_values: torch.Tensor | None = None,
                grid_thws: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                cache: K3Cache | None = None, attention_mask: torch.Tensor | None = None,
                validate: bool = True, logits_to_keep: int = 0) -> CausalLMOutput:
        """Logits (and the shifted loss) over the MERGED sequence [B, S, V] (§9.9).

        `pixel_values` [N, 3, P, P] are the packed normalised patches of all media items in placeholder order,
        `grid_thws` [n_items, 3] their (t, h, w) grids. `labels` and `attention_mask` (1 real, 0 left padding)
        are given per input token [B, T] and expanded with the features. With a `cache`, a prompt with media is
        prefilled once; later calls feed text tokens only (the mask then covers the new tokens only).
        `validate=False` skips the id and label checks, `logits_to_keep` N > 0 keeps the last N positions' logits
        (see `K3ForCausalLM.forward`).
        """
        if validate:
            self.check_input_ids(input_ids)
        self._check_media(input_ids, pixel_values, grid_thws)
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape "
                             f"{tuple(input_ids.shape)} (the model expands it with the media features)")
        features = [] if pixel_values is None else self.encode_media(pixel_values, grid_thws)
        layout = self.layout(input_ids, grid_thws)
        embeds_BrD, labels_Br, mask_Br = self.merge_inputs(input_ids, features, layout, labels, attention_mask)
        return self.language_model(inputs_embeds=embeds_BrD, labels=labels_Br, cache=cache, attention_mask=mask_Br,
                                   validate=validate, logits_to_keep=logits_to_keep)
