"""`k3.runtime`: glibc keeps freed memory for reuse (the command line calls it at start); a model's weights moved
onto transparent huge pages (`k3 generate` calls it after loading)."""

import ctypes
import ctypes.util
import subprocess
import sys

import pytest
import torch

from k3 import runtime
from k3.config import K3Config
from k3.model import K3ForCausalLM


def test_refuses_nothing_and_reports_whether_it_took_effect():
    """On glibc it succeeds; where the C library has no mallopt it is a no-op that says so."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    assert runtime.keep_freed_memory() is hasattr(libc, "mallopt")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc behaviour")
def test_a_large_freed_block_stays_resident():
    """After it, a freed 64 MiB tensor is not returned to the OS (glibc's default would unmap it at once)."""
    code = """
import torch
from k3.runtime import keep_freed_memory
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
keep = {flag}
if keep:
    assert keep_freed_memory()
before = rss()
x = torch.ones(16 * 2**20)  # 64 MiB, touched
del x
print((rss() - before) / 2**20)
"""
    grown = {flag: float(subprocess.run([sys.executable, "-c", code.format(flag=flag)], check=True,
                                        capture_output=True, text=True).stdout) for flag in (True, False)}
    assert grown[True] > 60 and grown[False] < 8


def test_huge_page_weights_moves_storage_not_values(monkeypatch, tmp_path):
    """In "madvise" mode the same parameter and buffer objects end up in one advised mapping (2 MiB-aligned start,
    64-byte-aligned tensors) with their values, and the model computes what it did; other modes change nothing."""
    model = K3ForCausalLM(K3Config.from_preset("k3-tiny")).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    objects = {name: t for name, t in (*model.named_parameters(), *model.named_buffers())}
    values = {name: t.clone() for name, t in objects.items()}
    for mode in ("never", "always"):
        monkeypatch.setattr(runtime, "_thp_mode", lambda mode=mode: mode)
        pointers = [t.data_ptr() for t in objects.values()]
        assert runtime.huge_page_weights(model) is False
        assert [t.data_ptr() for t in objects.values()] == pointers
    monkeypatch.setattr(runtime, "_thp_mode", lambda: "madvise")
    assert runtime.huge_page_weights(model) is True
    after = dict((*model.named_parameters(), *model.named_buffers()))
    assert all(after[name] is t for name, t in objects.items())  # the same objects: caches keyed on them hold
    assert all(torch.equal(after[name], v) for name, v in values.items())
    pointers = sorted(t.data_ptr() for t in after.values())
    assert pointers[0] % runtime.HUGE_PAGE == 0 and all(p % 64 == 0 for p in pointers)
    storages = {t.untyped_storage().data_ptr() for t in after.values()}
    assert len(storages) == 1  # one mapping
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    model.save_pretrained(tmp_path)  # each tensor copied out: safetensors refuses views of one storage
    loaded = K3ForCausalLM.from_pretrained(tmp_path).eval()
    assert all(torch.equal(t, values[name]) for name, t in loaded.state_dict().items())


def test_huge_page_weights_skips_a_small_module(monkeypatch):
    monkeypatch.setattr(runtime, "_thp_mode", lambda: "madvise")
    assert runtime.huge_page_weights(torch.nn.Linear(16, 16)) is False  # under one huge page of weights


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc behaviour")
def test_huge_page_weights_peaks_at_one_copy_under_keep_freed_memory():
    """With glibc keeping freed memory (as the command line sets it), moving 256 MiB of weights hands their old
    storage back as it goes: the peak resident size grows by the weights plus at most `RELEASE_EVERY` (and slack),
    not by two copies, and one copy stays resident."""
    code = """
import torch
from k3 import runtime
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
def peak():
    return runtime.peak_rss_gib() * 2**10
assert runtime.keep_freed_memory()
runtime._thp_mode = lambda: "madvise"
before = rss()
weights = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(8 * 2**20)) for _ in range(8))  # 8 x 32 MiB
assert runtime.huge_page_weights(weights)
print(peak() - before, rss() - before)
"""
    peak, now = map(float, subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                          text=True).stdout.split())
    assert peak < 256 + runtime.RELEASE_EVERY / 2**20 + 48 and 250 < now < 256 + 16, (peak, now)
