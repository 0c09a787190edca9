"""Vision: MoonViT-V2 encoder, patch merger + projector (docs/architecture.md §9)."""

from k3.vision.moonvit import MoonViT, check_grids
from k3.vision.projector import PatchMergerProjector, merge_patches

__all__ = ["MoonViT", "PatchMergerProjector", "check_grids", "merge_patches"]
