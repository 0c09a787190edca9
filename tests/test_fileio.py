"""`k3.fileio`: atomic files and directories, umask permissions, stale temporaries; the savers that use it."""

from __future__ import annotations

import errno
import os
import stat
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3 import fileio
from k3.fileio import (
    atomic_directory,
    atomic_open,
    atomic_path,
    atomic_write,
    check_writable_directory,
    describe_error,
    remove_stale_temporaries,
    staging_dir,
)


@pytest.fixture
def umask():
    """Set the process umask for one test (restored afterwards)."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_write_text_and_bytes_follow_the_umask(tmp_path, umask):
    """Files get 0o666 minus the umask like any other file (not mkstemp's 0o600); nothing else is left."""
    atomic_write(tmp_path / "a.txt", "héllo\n")
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "héllo\n" and mode(tmp_path / "a.txt") == 0o644
    umask(0o077)
    atomic_write(tmp_path / "a.txt", b"\x00\x01")
    assert (tmp_path / "a.txt").read_bytes() == b"\x00\x01" and mode(tmp_path / "a.txt") == 0o600
    assert os.listdir(tmp_path) == ["a.txt"]
    with pytest.raises(TypeError):
        atomic_write(tmp_path / "b", 3)


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "metrics.jsonl"
    target.write_text("old\n")
    with pytest.raises(RuntimeError, match="disk gone"), atomic_open(target) as f:
        f.write("half of the new")
        raise RuntimeError("disk gone")
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["metrics.jsonl"]


def test_atomic_path_fixes_a_writers_own_permissions(tmp_path, umask):
    """safetensors writes 0o600 files; through atomic_path they get the umask's 0o644 (and keep their suffix)."""
    with atomic_path(tmp_path / "w.safetensors") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-") and tmp.name.endswith("-w.safetensors")
        save_file({"x": torch.arange(3.0)}, tmp)
    assert mode(tmp_path / "w.safetensors") == 0o644
    assert torch.equal(load_file(tmp_path / "w.safetensors")["x"], torch.arange(3.0))
    assert os.listdir(tmp_path) == ["w.safetensors"]


def test_os_replace_failing_with_a_full_disk_leaves_no_temporary(tmp_path, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(tmp_path / "x", "data")
    assert os.listdir(tmp_path) == []


def test_atomic_directory_replaces_whole_and_keeps_on_failure(tmp_path, umask):
    final = tmp_path / "step_1"
    with atomic_directory(final) as staged:
        (staged / "a").write_text("1")
    assert mode(final) == 0o755 and os.listdir(final) == ["a"]
    with pytest.raises(OSError), atomic_directory(final) as staged:  # a save that fails halfway
        (staged / "b").write_text("2")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert os.listdir(final) == ["a"] and os.listdir(tmp_path) == ["step_1"]
    with atomic_directory(final) as staged:  # an existing directory is replaced as a whole
        (staged / "b").write_text("2")
    assert os.listdir(final) == ["b"] and os.listdir(tmp_path) == ["step_1"]
    with atomic_directory(final, keep_existing=True) as staged:  # a concurrent writer got there first
        (staged / "c").write_text("3")
    assert os.listdir(final) == ["b"] and os.listdir(tmp_path) == ["step_1"]


def test_staging_dir_is_removed_however_the_block_ends(tmp_path):
    with pytest.raises(KeyboardInterrupt), staging_dir(tmp_path, "x") as staged:
        (staged / "f").write_text("1")
        raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_remove_stale_temporaries(tmp_path):
    """`.tmp-*` and safetensors' `.tmpXXXXXX` go; `names` limits it to our temporaries of those files, and
    `older_than` to old ones; everything else stays."""
    for name in (".tmp-0123abcd-model", ".tmp-0123abcd-notes.txt", ".tmpAb12Cd", ".tmp-legacy", "keep", ".git"):
        (tmp_path / name).mkdir() if "model" in name else (tmp_path / name).write_text("x")
    (tmp_path / ".tmp-0123abcd-model" / "weights").write_text("x")
    removed = remove_stale_temporaries(tmp_path, names=["model"])
    assert [p.name for p in removed] == [".tmp-0123abcd-model"]
    assert remove_stale_temporaries(tmp_path, older_than=3600) == []  # all fresh
    old = time.time() - 7200
    os.utime(tmp_path / ".tmpAb12Cd", (old, old))
    assert [p.name for p in remove_stale_temporaries(tmp_path, older_than=3600)] == [".tmpAb12Cd"]
    remove_stale_temporaries(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [".git", "keep"]
    assert remove_stale_temporaries(tmp_path / "missing") == []


def test_check_writable_directory(tmp_path):
    target = check_writable_directory(tmp_path / "a" / "b")
    assert target.is_dir() and os.listdir(target) == []  # the probe is gone
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        check_writable_directory(tmp_path / "file")
    with pytest.raises(OSError):  # a parent that is a file
        check_writable_directory(tmp_path / "file" / "run")


def test_describe_error_is_one_line():
    assert describe_error(OSError(errno.ENOSPC, "No space left on device", "/x/y")) == \
        "No space left on device: '/x/y'"
    assert describe_error(KeyError("rng.cpu")) == "missing 'rng.cpu'"
    assert describe_error(ValueError("a\n  b\n")) == "a b"
    assert len(describe_error(ValueError("x" * 1000), limit=50)) == 50


# ------------------------------------------------------------------------------------------- the savers


def test_exported_weights_follow_the_umask_and_stale_temporaries_go(tmp_path, umask):
    """save_checkpoint_state (export, checkpoints) writes 0o644 files under umask 022 (it used to leave
    safetensors' 0o600) and removes what a killed save left in the directory."""
    from k3.checkpoint import save_checkpoint_state
    from k3.config import K3Config
    from k3.model import K3ForCausalLM

    config = K3Config.from_preset("k3-tiny", vocab_size=64, num_hidden_layers=2, full_attn_layers=[2],
                                  kda_layers=[1], num_experts=4, num_experts_per_token=2)
    model = K3ForCausalLM(config)
    (tmp_path / ".tmp-k1ll3d0x").mkdir()  # a killed export (mkdtemp's name) ...
    (tmp_path / ".tmp-k1ll3d0x" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / ".tmpQw3rTy").write_bytes(b"partial")  # ... and safetensors' own temporary
    save_checkpoint_state(tmp_path, model.official_state_dict(), config.kda_num_heads)
    model.config.save(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert mode(tmp_path / "model.safetensors") == 0o644 and mode(tmp_path / "config.json") == 0o644
    save_checkpoint_state(tmp_path / "sharded", model.official_state_dict(), config.kda_num_heads,
                          max_shard_size=2**16)
    files = os.listdir(tmp_path / "sharded")
    assert len(files) > 2 and all(mode(tmp_path / "sharded" / f) == 0o644 for f in files)


def test_tokenizer_and_processor_files_follow_the_umask(tmp_path, umask):
    from k3.tokenizer import train_bpe
    from k3.vision.processor import ImageProcessorConfig

    umask(0o027)
    train_bpe(["abc abd abe " * 20], vocab_size=272, num_special_slots=16).save(tmp_path)
    ImageProcessorConfig().save(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["preprocessor_config.json", "tiktoken.model", "tokenizer_config.json"]
    assert all(mode(tmp_path / f) == 0o640 for f in os.listdir(tmp_path))
