"""Translation between the model's internal state dict and the official HF tensor names (docs/architecture.md §11).

The internal names are the official text names (§11.2, without the ``language_model.`` prefix) with two
exceptions (§11.4 items 1-2):

* KDA ``model.layers.N.self_attn.A_log`` is ``[H]`` internally and zero-padded to ``ceil(H/128)*128`` in
  the file;
* routed experts are stacked internally as ``model.layers.N.block_sparse_moe.experts.w{1,2,3}``
  ``[E, out, in]`` (dense) or ``...experts.w{1,2,3}.weight_packed`` ``[E, out, in/2]`` + ``.weight_scale``
  ``[E, out, in/32]`` (MXFP4 kept packed, §11.5), and stored per expert as ``experts.{e}.w{1,2,3}.weight`` or
  ``experts.{e}.w{1,2,3}.weight_packed`` + ``.weight_scale``. Either stored form loads into either internal form
  (decoded, or encoded expert by expert); ``convert_experts`` changes the form of a state dict before saving.

Translation is driven by the model's own state-dict keys, never by tensor shapes (§11.4 item 5).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, Union

import torch
from torch import Tensor

from k3.ops.mxfp4 import GROUP_SIZE, MXFP4Weight, check_mxfp4_pair, decode_mxfp4, encode_mxfp4
from k3.config import summarize
from k3.ops.precision import is_fp32_tensor

LANGUAGE_MODEL_PREFIX = "language_model."
NON_TEXT_PREFIXES = ("vision_tower.", "mm_projector.")
A_LOG_PAD_MULTIPLE = 128

MXFP4_DECODE_DTYPE = torch.bfloat16
"""Dtype of decoded MXFP4 experts when the caller asks for none; every FP4 x E8M0 value is exact in bf16."""

_A_LOG = re.compile(r"model\.layers\.\d+\.self_attn\.A_log")
_STACKED_EXPERTS = re.compile(r"model\.layers\.\d+\.block_sparse_moe\.experts\.w[123]")
_PACKED_EXPERTS = re.compile(r"(model\.layers\.\d+\.block_sparse_moe\.experts\.w[123])\.weight_(packed|scale)")
_EXPERT_WEIGHT = re.compile(r"(.+\.experts)\.(\d+)\.(w[123])\.(?:weight|weight_packed|weight_scale)")
REPORT_LIMIT = 5
"""How many names of each kind of mismatch an error message lists (the rest are counted)."""


class CheckpointError(ValueError):
    """A checkpoint does not match the model or is malformed."""


class LazyTensor(Protocol):
    """A stored tensor whose shape and dtype are known before its data is read (e.g. one safetensors entry)."""

    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def load(self) -> Tensor: ...


StoredTensor = Union[Tensor, LazyTensor]
ExpectedShape = Union[Tensor, torch.Size, Sequence[int]]
Loader = Callable[[], Tensor]


def padded_a_log_length(num_kda_heads: int) -> int:
    """Length of the stored ``A_log``: the KDA head count rounded up to a multiple of 128 (§11.4 item 1)."""
    return math.ceil(num_kda_heads / A_LOG_PAD_MULTIPLE) * A_LOG_PAD_MULTIPLE


def expert_weight_name(stacked_name: str, expert: int, suffix: str = "weight") -> str:
    """Official name of one expert's slice: ``...experts.w1`` -> ``...experts.{expert}.w1.{suffix}``."""
    experts, projection = stacked_name.rsplit(".", 1)
    return f"{experts}.{expert}.{projection}.{suffix}"


# ----------------------------------------------------------------------------------------------- internal -> HF


def to_hf_state_dict(state_dict: Mapping[str, Tensor], num_kda_heads: int) -> dict[str, Tensor]:
    """Internal state dict -> official text tensors (no ``language_model.`` prefix), §11.2/§11.4.

    ``A_log`` is zero-padded to ``padded_a_log_length(num_kda_heads)``; stacked experts (dense or packed) are split
    into per-expert views (no copies). Every other tensor is passed through unchanged.
    """
    hf: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        packed = _PACKED_EXPERTS.fullmatch(name)
        if _STACKED_EXPERTS.fullmatch(name) or packed:
            stacked, suffix = (packed[1], f"weight_{packed[2]}") if packed else (name, "weight")
            hf.update((expert_weight_name(stacked, e, suffix), weight) for e, weight in enumerate(tensor.unbind(0)))
        elif _A_LOG.fullmatch(name):
            hf[name] = _pad_a_log(name, tensor, num_kda_heads)
        else:
            hf[name] = tensor
    return hf


def _pad_a_log(name: str, a_log: Tensor, num_kda_heads: int) -> Tensor:
    """Zero-pad an internal ``[H]`` ``A_log`` to its stored length (§11.4 item 1)."""
    if tuple(a_log.shape) != (num_kda_heads,):
        raise CheckpointError(f"{name}: expected [{num_kda_heads}] (KDA heads), got {list(a_log.shape)}")
    padding = a_log.new_zeros(padded_a_log_length(num_kda_heads) - num_kda_heads)
    return torch.cat((a_log, padding))


# ----------------------------------------------------------------------------------------------- HF -> internal


def from_hf_state_dict(
    hf_tensors: Mapping[str, StoredTensor],
    expected: Mapping[str, ExpectedShape],
    dtype: torch.dtype | None = None,
) -> dict[str, Tensor]:
    """Official tensors -> internal state dict with exactly the keys and shapes of ``expected`` (§11).

    ``hf_tensors`` may carry the ``language_model.`` prefix. Vision and projector tensors (``vision_tower.*``,
    ``mm_projector.*``) keep their names; they are skipped when ``expected`` asks for none of them (a text-only
    model reading a multimodal checkpoint, §11.1). Values may be tensors or ``LazyTensor``s: all names, shapes and
    dtypes are checked before any data is read, and every problem (missing, unexpected, mis-shaped, wrong dtype) is
    reported in one one-line ``CheckpointError`` (each kind counted, its first ``REPORT_LIMIT`` named).

    Dtypes: a stored tensor must be floating point (integer or bool data where a weight belongs is reported, not
    cast), except where ``expected`` gives a tensor of another dtype (then that dtype exactly) and the MXFP4 pairs
    (uint8). The fp32 set (``is_fp32_tensor``) always ends fp32; other floating tensors are cast to ``dtype``
    when given, else keep their stored dtype; MXFP4 experts decode to ``dtype`` or bf16 where ``expected`` has dense
    experts, and stay packed (or are encoded, from dense ones) where it has packed ones. Dtypes are checked with
    the names and shapes, before any data is read.
    """
    keep_media = any(name.startswith(NON_TEXT_PREFIXES) for name in expected)
    matcher = _Matcher(_strip_text_prefix(hf_tensors, keep_media))
    loaders: dict[str, Loader] = {}
    for name, spec in expected.items():
        packed = _PACKED_EXPERTS.fullmatch(name)
        if packed and name not in loaders:
            loaders.update(_plan_packed_experts(matcher, packed[1], _shape_of(spec), packed[2] == "scale"))
        elif not packed:
            loaders[name] = _plan(matcher, name, spec, dtype)
    matcher.raise_on_problems()
    return {name: load() for name, load in loaders.items()}


def _strip_text_prefix(hf_tensors: Mapping[str, StoredTensor], keep_media: bool) -> dict[str, StoredTensor]:
    """Strip ``language_model.``; drop vision/projector tensors unless ``keep_media`` (§11.1)."""
    text: dict[str, StoredTensor] = {}
    for name, tensor in hf_tensors.items():
        if name.startswith(NON_TEXT_PREFIXES) and not keep_media:
            continue
        short = name.removeprefix(LANGUAGE_MODEL_PREFIX)
        if short in text:
            raise CheckpointError(f"{short} is stored both with and without the {LANGUAGE_MODEL_PREFIX!r} prefix")
        text[short] = tensor
    return text


def _plan(matcher: _Matcher, name: str, spec: ExpectedShape, dtype: torch.dtype | None) -> Loader:
    """Claim the stored tensors that make up internal tensor ``name`` and return how to build it."""
    shape = _shape_of(spec)
    if _STACKED_EXPERTS.fullmatch(name):
        num_experts, *expert_shape = shape
        present = matcher.stored_experts(name, num_experts, tuple(expert_shape))  # the others are reported
        experts = [_plan_expert(matcher, name, e, tuple(expert_shape), dtype) for e in present]
        return lambda: _stack(experts)
    want = _required_dtype(spec)
    if _A_LOG.fullmatch(name):
        (num_heads,) = shape
        matcher.claim(name, (padded_a_log_length(num_heads),), want)
        return lambda: _cast(name, matcher.load(name)[:num_heads].clone(), dtype)
    matcher.claim(name, shape, want)
    return lambda: _cast(name, matcher.load(name), dtype)


def _required_dtype(spec: ExpectedShape) -> torch.dtype | None:
    """The exact dtype a stored tensor must have (an expected non-floating tensor), or None: any floating dtype."""
    expected = getattr(spec, "dtype", None)
    return expected if isinstance(expected, torch.dtype) and not expected.is_floating_point else None


def _plan_expert(
    matcher: _Matcher, stacked_name: str, expert: int, shape: tuple[int, ...], dtype: torch.dtype | None
) -> Loader:
    """One expert's ``[out, in]`` matrix: stored dense (``.weight``) or as an MXFP4 pair (§11.5)."""
    dense, packed, scale = (expert_weight_name(stacked_name, expert, suffix)
                            for suffix in ("weight", "weight_packed", "weight_scale"))
    if matcher.has(dense) or not (matcher.has(packed) or matcher.has(scale)):
        matcher.claim(dense, shape)
        return lambda: _cast(dense, matcher.load(dense), dtype)
    out_features, in_features = shape
    matcher.claim(packed, (out_features, in_features // 2), torch.uint8)
    matcher.claim(scale, (out_features, in_features // GROUP_SIZE), torch.uint8)

    def decode() -> Tensor:
        packed_data, scale_data = matcher.load(packed), matcher.load(scale)
        try:
            return decode_mxfp4(packed_data, scale_data, dtype or MXFP4_DECODE_DTYPE)
        except ValueError as error:  # e.g. the E8M0 NaN code in the scales
            raise CheckpointError(f"{packed} / {scale}: {error}") from None

    return decode


def _plan_packed_experts(matcher: _Matcher, stacked_name: str, shape: tuple[int, ...],
                         is_scale: bool) -> dict[str, Loader]:
    """Both internal tensors of packed experts ``stacked_name.weight_packed`` [E, out, in/2] and ``.weight_scale``
    [E, out, in/32], from per-expert MXFP4 pairs (copied) or dense matrices (encoded, each once)."""
    num_experts, out_features, width = shape
    in_features = width * (GROUP_SIZE if is_scale else 2)
    present = matcher.stored_experts(stacked_name, num_experts, (out_features, in_features))
    experts = [_plan_packed_expert(matcher, stacked_name, e, (out_features, in_features)) for e in present]
    built: list[tuple[Tensor, Tensor]] = []

    def load(part: int) -> Tensor:
        if not built:  # the first of the two loads fills both, one expert at a time
            pair = tuple(torch.empty(len(experts), out_features, in_features // per_byte, dtype=torch.uint8)
                         for per_byte in (2, GROUP_SIZE))
            for e, load_expert in enumerate(experts):
                pair[0][e], pair[1][e] = load_expert()
            built.append(pair)
        return built[0][part]

    return {f"{stacked_name}.weight_packed": lambda: load(0), f"{stacked_name}.weight_scale": lambda: load(1)}


def _plan_packed_expert(matcher: _Matcher, stacked_name: str, expert: int,
                        shape: tuple[int, int]) -> Callable[[], tuple[Tensor, Tensor]]:
    """One expert's MXFP4 pair: stored as one (checked, then copied), or encoded from a stored dense matrix."""
    dense, packed, scale = (expert_weight_name(stacked_name, expert, suffix)
                            for suffix in ("weight", "weight_packed", "weight_scale"))
    if matcher.has(dense) or not (matcher.has(packed) or matcher.has(scale)):
        matcher.claim(dense, shape)
        return lambda: encode_mxfp4(matcher.load(dense))
    out_features, in_features = shape
    matcher.claim(packed, (out_features, in_features // 2), torch.uint8)
    matcher.claim(scale, (out_features, in_features // GROUP_SIZE), torch.uint8)

    def load() -> tuple[Tensor, Tensor]:
        pair = matcher.load(packed), matcher.load(scale)
        try:
            check_mxfp4_pair(*pair)
        except ValueError as error:  # e.g. the E8M0 NaN code in the scales
            raise CheckpointError(f"{packed} / {scale}: {error}") from None
        return pair

    return load


def convert_experts(state_dict: Mapping[str, Tensor], experts: str) -> dict[str, Tensor]:
    """``state_dict`` with its stacked routed experts in ``experts`` form: "dense" (packed ones decoded to bf16,
    exact) or "mxfp4" (dense ones encoded, expert by expert); every other tensor passed through."""
    converted: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        packed = _PACKED_EXPERTS.fullmatch(name)
        if experts == "mxfp4" and _STACKED_EXPERTS.fullmatch(name):
            weight = MXFP4Weight(*tensor.shape).quantize_(tensor)
            converted[f"{name}.weight_packed"], converted[f"{name}.weight_scale"] = weight.weight_packed, \
                weight.weight_scale
        elif experts == "dense" and packed:
            if packed[2] == "packed":
                converted[packed[1]] = decode_mxfp4(tensor, state_dict[f"{packed[1]}.weight_scale"],
                                                    MXFP4_DECODE_DTYPE)
        else:
            converted[name] = tensor
    return converted


def _stack(experts: Sequence[Loader]) -> Tensor:
    """Stack per-expert matrices into ``[E, out, in]``, holding at most one extra expert in memory."""
    first = experts[0]()
    stacked = torch.empty((len(experts), *first.shape), dtype=first.dtype)
    stacked[0] = first
    for e, load in enumerate(experts[1:], start=1):
        stacked[e] = load()
    return stacked


def _cast(name: str, tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    """Apply the dtype rules of §0.4 / §11.1 to one loaded tensor."""
    if not tensor.is_floating_point():
        return tensor
    if is_fp32_tensor(name):
        return tensor.float()
    return tensor if dtype is None else tensor.to(dtype)


def _shape_of(tensor_or_shape: StoredTensor | ExpectedShape) -> tuple[int, ...]:
    shape = getattr(tensor_or_shape, "shape", tensor_or_shape)
    return tuple(int(n) for n in shape)


def _format_shape(shape: Sequence[int]) -> str:
    return f"[{', '.join(str(n) for n in shape)}]"


class _Matcher:
    """Hands out stored tensors by name and records every missing, mis-shaped, mis-typed and unclaimed one.

    The work and the memory of the bookkeeping are bounded by the stored tensors, not by ``expected``: absent
    experts are counted, not listed, and each kind of problem keeps only its first ``REPORT_LIMIT`` lines.
    """

    def __init__(self, stored: Mapping[str, StoredTensor]) -> None:
        self._stored = stored
        self._claimed: set[str] = set()
        self._lines: dict[str, list[str]] = {kind: [] for kind in _PROBLEM_KINDS}
        self._counts = dict.fromkeys(self._lines, 0)
        self._experts: dict[str, set[int]] = {}  # stacked internal name -> expert indices with a stored tensor
        for stored_name in stored:
            match = _EXPERT_WEIGHT.fullmatch(stored_name)
            if match and str(int(match[2])) == match[2]:
                self._experts.setdefault(f"{match[1]}.{match[3]}", set()).add(int(match[2]))

    def has(self, name: str) -> bool:
        return name in self._stored

    def _record(self, kind: str, lines: Iterable[str], count: int = 1) -> None:
        self._counts[kind] += count
        room = REPORT_LIMIT - len(self._lines[kind])
        self._lines[kind].extend(itertools.islice(lines, max(room, 0)))

    def claim(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
        """Mark ``name`` as used, recording a problem if it is absent, not of ``shape`` or of the wrong dtype
        (``dtype``, or any floating dtype if None)."""
        if name not in self._stored:
            self._record("missing", [f"{name}: expected {_format_shape(shape)}"])
            return
        self._claimed.add(name)
        found = _shape_of(self._stored[name])
        if found != shape:
            self._record("mis-shaped", [f"{name}: expected {_format_shape(shape)}, found {_format_shape(found)}"])
        stored_dtype = getattr(self._stored[name], "dtype", None)
        if stored_dtype is None:
            return
        if dtype is None and not stored_dtype.is_floating_point:
            self._record("with a wrong dtype", [f"{name}: stored as {_dtype_name(stored_dtype)}, expected a "
                                                "floating-point dtype"])
        elif dtype is not None and stored_dtype != dtype:
            self._record("with a wrong dtype", [f"{name}: stored as {_dtype_name(stored_dtype)}, expected "
                                                f"{_dtype_name(dtype)}"])

    def stored_experts(self, stacked_name: str, num_experts: int, expert_shape: tuple[int, ...]) -> list[int]:
        """Indices below ``num_experts`` of the experts of ``stacked_name`` that have a stored tensor; the others
        are recorded as missing (counted; the first few named), without enumerating the names of absent ones."""
        present = sorted(e for e in self._experts.get(stacked_name, ()) if e < num_experts)
        if len(present) < num_experts:
            have = set(present)
            absent = (f"{expert_weight_name(stacked_name, e)}: expected {_format_shape(expert_shape)}"
                      for e in range(num_experts) if e not in have)
            self._record("missing", absent, num_experts - len(present))
        return present

    def load(self, name: str) -> Tensor:
        tensor = self._stored[name]
        return tensor if isinstance(tensor, Tensor) else tensor.load()

    def raise_on_problems(self) -> None:
        """Raise one ``CheckpointError`` line: the count of each kind of problem and its first few names."""
        unexpected = [name for name in self._stored if name not in self._claimed]
        if unexpected:
            self._record("unexpected", (f"{name}: found {_format_shape(_shape_of(self._stored[name]))}"
                                        for name in unexpected), len(unexpected))
        problems = sum(self._counts.values())
        if not problems:
            return
        report = ", ".join(f"{count:,} {kind} ({summarize(self._lines[kind], count, sep='; ')})"
                           for kind, count in self._counts.items() if count)
        raise CheckpointError(f"checkpoint does not match the model ({problems:,} problem{'s' * (problems > 1)}): "
                              f"{report}")


_PROBLEM_KINDS = ("missing", "unexpected", "mis-shaped", "with a wrong dtype")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
