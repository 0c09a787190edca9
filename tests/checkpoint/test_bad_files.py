"""Malformed checkpoints fail with one CheckpointError line naming the file (or tensor) and the problem:
corrupt safetensors files, integer data where weights belong, bad indexes, index entries outside the directory,
and mismatch reports of absurd size (docs/architecture.md §11.1)."""

import json
import struct
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3 import K3Config
from k3.checkpoint import CheckpointError, encode_mxfp4, from_hf_state_dict, load_checkpoint_state
from k3.cli import main
from k3.model import K3ForCausalLM

STACKED = "model.layers.1.block_sparse_moe.experts"
EXPECTED = {"model.norm.weight": (4,), "lm_head.weight": (6, 4), f"{STACKED}.w1": (2, 3, 32)}


def stored_tensors() -> dict:
    """Official tensors matching EXPECTED (experts stored per expert)."""
    return {"model.norm.weight": torch.ones(4), "lm_head.weight": torch.randn(6, 4),
            **{f"{STACKED}.{e}.w1.weight": torch.randn(3, 32) for e in range(2)}}


def error_of(call, *args, **kwargs) -> str:
    with pytest.raises(CheckpointError) as exc:
        call(*args, **kwargs)
    message = str(exc.value)
    assert "\n" not in message and exc.value.__cause__ is None, message
    return message


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A k3-tiny checkpoint written by save_pretrained (the released layout)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    K3ForCausalLM(K3Config.from_preset("k3-tiny")).save_pretrained(path)
    return path


def copy_checkpoint(src, dst):
    dst.mkdir(exist_ok=True)
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


# ------------------------------------------------------------------------------------- corrupt safetensors
def _edit_header(data: bytes, edit) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header[next(k for k in header if k != "__metadata__")])
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


def _header_claims_more(data: bytes) -> bytes:
    return _edit_header(data, lambda entry: entry["data_offsets"].__setitem__(1, entry["data_offsets"][1] + 10**6))


def _unknown_dtype(data: bytes) -> bytes:
    return _edit_header(data, lambda entry: entry.__setitem__("dtype", "XYZ"))


def _shape_grows(data: bytes) -> bytes:
    return _edit_header(data, lambda entry: entry["shape"].__setitem__(1, entry["shape"][1] + 1))


def _offsets_reversed(data: bytes) -> bytes:
    return _edit_header(data, lambda entry: entry.__setitem__("data_offsets", entry["data_offsets"][::-1]))


CORRUPTIONS = [
    ("truncated data", lambda d: d[:-100], "truncated: its header describes"),
    ("truncated header", lambda d: d[:50], "truncated or not a safetensors file: its first 8 bytes announce"),
    ("garbage", lambda d: bytes(range(256)) * 4, "truncated or not a safetensors file"),
    ("zero bytes", lambda d: b"", "empty file, not a safetensors file"),
    ("three bytes", lambda d: b"abc", "only 3 bytes, not a safetensors file"),
    ("header not JSON", lambda d: struct.pack("<Q", 5) + b"hello", "its header is not valid JSON"),
    ("header claims more data", _header_claims_more, "truncated: its header describes 1,00"),
    ("trailing bytes", lambda d: d + b"junk", "4 bytes follow the"),
    ("unknown dtype", _unknown_dtype, "tensor lm_head.weight has dtype XYZ, which torch cannot load"),
    ("data does not fit the shape", _shape_grows, "the data of 1 tensor does not fit its dtype and shape "
                                                  "(lm_head.weight: F32 [6, 5] in 96 bytes)"),
    ("malformed entry", _offsets_reversed, "malformed header entries for lm_head.weight"),
]


@pytest.mark.parametrize("case,corrupt,expected", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corrupt_file_is_a_checkpoint_error_naming_it(tmp_path, case, corrupt, expected):
    """Not a raw SafetensorError: one line with the file's path and what is wrong with it."""
    file = tmp_path / "model.safetensors"
    save_file(stored_tensors(), file)
    file.write_bytes(corrupt(file.read_bytes()))
    message = error_of(load_checkpoint_state, tmp_path, EXPECTED)
    assert message.startswith(f"{file}: ") and expected in message, message


def test_corrupt_shard_is_named_by_from_pretrained(tiny_dir, tmp_path):
    """from_pretrained on a sharded checkpoint with one truncated shard names that shard."""
    tensors = load_file(tiny_dir / "model.safetensors")
    names = sorted(tensors)
    weight_map = {name: f"model-0000{1 + 2 * i // len(names)}-of-00002.safetensors" for i, name in enumerate(names)}
    for shard in set(weight_map.values()):
        save_file({n: tensors[n] for n, f in weight_map.items() if f == shard}, tmp_path / shard)
    write_index(tmp_path, {"weight_map": weight_map})
    (tmp_path / "config.json").write_bytes((tiny_dir / "config.json").read_bytes())
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert error_of(K3ForCausalLM.from_pretrained, tmp_path).startswith(f"{shard}: truncated")


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_weight_is_reported_not_cast(tiny_dir, tmp_path, dtype):
    """model.embed_tokens.weight saved as integers or bools: the error names the tensor and its dtype."""
    copy_checkpoint(tiny_dir, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    name = "language_model.model.embed_tokens.weight"
    stored[name] = stored[name].to(dtype)
    save_file(stored, tmp_path / "model.safetensors")
    message = error_of(K3ForCausalLM.from_pretrained, tmp_path)
    dtype_name = str(dtype).removeprefix("torch.")
    assert (f"1 with a wrong dtype (model.embed_tokens.weight: stored as {dtype_name}, expected a floating-point "
            "dtype)") in message


def test_mxfp4_pairs_must_be_uint8_and_decodable():
    """MXFP4 experts stay integer (uint8 pairs); a float-typed pair or a NaN scale names the tensor."""
    weights = torch.randn(2, 3, 32)
    hf = {k: v for k, v in stored_tensors().items() if ".experts." not in k}
    for e in range(2):
        hf[f"{STACKED}.{e}.w1.weight_packed"], hf[f"{STACKED}.{e}.w1.weight_scale"] = encode_mxfp4(weights[e])
    assert from_hf_state_dict(hf, EXPECTED)[f"{STACKED}.w1"].shape == (2, 3, 32)  # legitimately integer
    bad = hf | {f"{STACKED}.1.w1.weight_packed": hf[f"{STACKED}.1.w1.weight_packed"].float()}
    assert f"{STACKED}.1.w1.weight_packed: stored as float32, expected uint8" in error_of(from_hf_state_dict, bad,
                                                                                          EXPECTED)
    nan_scale = hf | {f"{STACKED}.0.w1.weight_scale": torch.full((3, 1), 255, dtype=torch.uint8)}
    assert error_of(from_hf_state_dict, nan_scale, EXPECTED).startswith(f"{STACKED}.0.w1.weight_packed / ")


# ------------------------------------------------------------------------------------------------- index files
def sharded(tmp_path) -> dict:
    """Two shards and an index; returns the weight_map."""
    tensors = stored_tensors()
    names = sorted(tensors)
    weight_map = {name: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, name in enumerate(names)}
    for shard in set(weight_map.values()):
        save_file({n: tensors[n] for n, f in weight_map.items() if f == shard}, tmp_path / shard)
    write_index(tmp_path, {"metadata": {}, "weight_map": weight_map})
    return weight_map


def write_index(directory, index) -> None:
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_valid_sharded_checkpoint_loads(tmp_path):
    sharded(tmp_path)
    assert load_checkpoint_state(tmp_path, EXPECTED).keys() == EXPECTED.keys()


@pytest.mark.parametrize("index,expected", [
    ({"metadata": {}, "weight_map": ["model-00001-of-00002.safetensors"]},
     "weight_map must be an object mapping tensor names to file names, got ['model-00001-of-00002.safetensors']"),
    ({"metadata": {}}, "must be a JSON object with a weight_map, got keys metadata"),
    ([1, 2], "must be a JSON object with a weight_map, got [1, 2]"),
    ({"weight_map": {"model.norm.weight": 3, "lm_head.weight": None}},
     "weight_map values must be file names (strings); 2 are not: model.norm.weight: 3; lm_head.weight: null"),
], ids=["weight_map list", "no weight_map", "not an object", "values not strings"])
def test_malformed_index_names_the_field(tmp_path, index, expected):
    sharded(tmp_path)
    write_index(tmp_path, index)
    assert error_of(load_checkpoint_state, tmp_path, EXPECTED) == (
        f"{tmp_path / 'model.safetensors.index.json'}: {expected}")


def test_index_that_is_not_json(tmp_path):
    sharded(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ')
    assert error_of(load_checkpoint_state, tmp_path, EXPECTED).startswith(
        f"{tmp_path / 'model.safetensors.index.json'}: not valid JSON (")


@pytest.mark.parametrize("entry", ["../outside/model.safetensors", "ABSOLUTE", "sub/model-00001-of-00002.safetensors",
                                   "..", "."])
def test_index_may_only_name_files_inside_the_directory(tmp_path, entry):
    """An index entry with a path (relative, absolute, .., a subdirectory) is refused even if the file exists
    and is a valid safetensors file; the error names the index entry."""
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"model.norm.weight": torch.full((4,), 7.0)}, outside / "model.safetensors")
    checkpoint = tmp_path / "checkpoint"
    (checkpoint / "sub").mkdir(parents=True)
    weight_map = sharded(checkpoint)
    (checkpoint / "sub" / "model-00001-of-00002.safetensors").write_bytes(
        (checkpoint / "model-00001-of-00002.safetensors").read_bytes())
    entry = str(outside / "model.safetensors") if entry == "ABSOLUTE" else entry
    shard = weight_map["model.norm.weight"]
    names_in_shard = [n for n, f in weight_map.items() if f == shard]
    write_index(checkpoint, {"weight_map": weight_map | {n: entry for n in names_in_shard}})
    message = error_of(load_checkpoint_state, checkpoint, EXPECTED)
    assert message.startswith(f"{checkpoint / 'model.safetensors.index.json'}: weight_map may only name files "
                              f"inside the checkpoint directory; {len(names_in_shard)} entries do not: ")
    assert f"model.norm.weight: {entry!r}" in message


def test_symlinked_shards_load_like_a_hugging_face_cache_snapshot(tmp_path):
    """Files inside the directory that are symlinks (snapshots/<rev>/x -> ../../blobs/<hash>) are followed."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    weight_map = sharded(blobs)
    for file in set(weight_map.values()) | {"model.safetensors.index.json"}:
        (snapshot / file).symlink_to(f"../../blobs/{file}")
    assert load_checkpoint_state(snapshot, EXPECTED).keys() == EXPECTED.keys()


def test_a_file_where_a_checkpoint_directory_is_expected(tiny_dir):
    """from_pretrained / load_checkpoint_state on a file other than .safetensors name it and say what is expected."""
    config = tiny_dir / "config.json"
    assert error_of(load_checkpoint_state, config, EXPECTED) == (
        f"{config} is a file but not a .safetensors file; expected a checkpoint directory (config.json + "
        "safetensors weights) or a .safetensors file")
    assert "is a file but not a .safetensors file" in error_of(K3ForCausalLM.from_pretrained, config)
    with pytest.raises(ValueError, match="is a file; expected a checkpoint directory with config.json"):
        K3ForCausalLM.from_pretrained(tiny_dir / "model.safetensors")


# ---------------------------------------------------------------------------------------- bounded reports
def test_absurd_expert_count_fails_fast_with_a_short_message():
    """A million experts expected, two stored: counted, not listed, and found in well under a second of work."""
    start = time.perf_counter()
    message = error_of(from_hf_state_dict, stored_tensors(), {**EXPECTED, f"{STACKED}.w1": (10**6, 3, 32)})
    assert time.perf_counter() - start < 5
    assert len(message) < 1000, len(message)
    assert (f"999,998 missing ({STACKED}.2.w1.weight: expected [3, 32]; {STACKED}.3.w1.weight: expected [3, 32]; "
            f"{STACKED}.4.w1.weight: expected [3, 32]; {STACKED}.5.w1.weight: expected [3, 32]; "
            f"{STACKED}.6.w1.weight: expected [3, 32] and 999,993 more)") in message


def test_every_kind_of_problem_is_summarised():
    """Thousands of unexpected, missing and mis-shaped tensors: five of each are named, the rest counted."""
    stored = stored_tensors() | {f"model.extra.{i}": torch.zeros(1) for i in range(5000)}
    expected = EXPECTED | {f"model.absent.{i}": (2,) for i in range(3000)} | {"model.norm.weight": (5,)}
    message = error_of(from_hf_state_dict, stored, expected)
    assert message.startswith("checkpoint does not match the model (8,001 problems): 3,000 missing (")
    assert "and 2,995 more), 5,000 unexpected (model.extra.0: found [1]; " in message
    assert "and 4,995 more), 1 mis-shaped (model.norm.weight: expected [5], found [4])" in message
    assert len(message) < 1000


def test_many_missing_shards_are_summarised(tmp_path):
    weight_map = {f"model.t{i}": f"model-{i:05d}-of-09999.safetensors" for i in range(1, 10000)}
    write_index(tmp_path, {"weight_map": weight_map})
    message = error_of(load_checkpoint_state, tmp_path, EXPECTED)
    assert message.endswith("refers to missing files: model-00001-of-09999.safetensors, "
                            "model-00002-of-09999.safetensors, model-00003-of-09999.safetensors, "
                            "model-00004-of-09999.safetensors, model-00005-of-09999.safetensors and 9,994 more")


def test_config_with_absurd_expert_count_fails_fast_but_k3_info_works(tiny_dir, tmp_path, capsys):
    """config.json claims 50,000 experts for a 16-expert checkpoint: from_pretrained fails at once with a short
    message; `k3 info` (meta device) still reports the configured architecture."""
    copy_checkpoint(tiny_dir, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["num_experts"] = 50_000
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = error_of(K3ForCausalLM.from_pretrained, tmp_path)
    assert len(message) < 2000
    assert "1,199,616 missing (" in message  # 8 MoE layers x 3 projections x (50,000 - 16) experts
    assert main(["info", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["components"]["routed_experts"]["total"] == 8 * 3 * 50_000 * 96 * 64
