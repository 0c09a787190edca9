"""The compiled CPU kernels (C++ beside the op that uses them), built with PyTorch's extension builder.

`load(name)` compiles the kernel's source (`KERNELS`) on first use (g++, and ninja from the `ninja` package; ≈ 40 s
per kernel) into PyTorch's per-user extension cache (`$TORCH_EXTENSIONS_DIR`, else ~/.cache/torch_extensions), in a
directory per kernel, CPU capability (`-mavx2 -mfma` where PyTorch itself runs AVX2 kernels), Python and PyTorch
version, and returns the module; later processes load it from there. Where it cannot be built (no
compiler), `load` returns None and `available` warns once with the reason: every caller then keeps its torch ops.
`python -m k3.ops.build` builds them all ahead of time (`make` does, while installing) and fails loudly where one
cannot be built, unless told that the torch ops may serve (`--allow-missing`, `K3_KERNELS=optional`).
"""

import contextlib
import fcntl
import functools
import os
import shutil
import sys
import sysconfig
import warnings

import torch
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

KERNELS = {  # name: source file, relative to this package
    "kda": os.path.join("kda", "cpu_kernel.cpp"),  # the chunkwise KDA core (k3.ops.kda.cpu, §3.12)
    "matvec": "matvec_kernel.cpp",  # few-row products of decoding (k3.ops.matvec)
    "activation": "activation_kernel.cpp",  # SiTU-GLU in one pass each way (k3.ops.activation)
    "decode": "decode_kernel.cpp",  # norms, AttnRes mix and the KDA step of one-token calls (k3.ops.decode)
    "norm": "norm_kernel.cpp",  # norms and the AttnRes mix of many rows, forward and backward (k3.ops.norm)
    "loss": "loss_kernel.cpp",  # the next-token cross-entropy, forward and backward (k3.ops.loss)
    "mxfp4": "mxfp4_kernel.cpp",  # MXFP4 experts' products, each block decoded in registers (k3.ops.mxfp4)
    "attention": os.path.join("attention", "cpu_kernel.cpp"),  # blocked causal softmax attention (k3.ops.attention)
}
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
# the few-row kernels serve calls of at most this many rows (a decode step of up to 16 sequences): their products
# take each weight row with every input row in register tiles, and a sequence's values are the same alone or batched
# (a weight that fits in cache goes faster through a matrix product from about 8 rows; k3-small's lm_head at 16 rows
# does not: 4.9 ms against 13.1)
MAX_ROWS = 16
_VECTOR_FLAGS = {  # by the capability PyTorch itself detected on this CPU; the defines select ATen's matching
    # `Vectorized` (its SLEEF tanh and exp, exported by PyTorch's library)
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
}


@functools.cache
def build(name: str):
    """(the compiled module `name` of `KERNELS`, None) or (None, why it is unavailable)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", *_VECTOR_FLAGS.get(capability, [])]
    if shutil.which("ninja") is None:  # the builder runs `ninja` from PATH; the `ninja` package puts it beside python
        os.environ["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    here = os.path.dirname(os.path.abspath(__file__))
    source = os.path.join(here, KERNELS[name])
    directory = _build_directory(name, capability)
    try:
        from torch.utils.cpp_extension import load as load_extension

        with exclusive_build(directory):
            module = load_extension(name=f"k3_{name}_{capability.lower()}", sources=[source], extra_cflags=flags,
                                    extra_include_paths=[here], extra_ldflags=["-fopenmp"],
                                    build_directory=directory, verbose=False)
    except Exception as err:  # no compiler, no ninja, a failed build: the torch ops serve every call
        return None, f"{type(err).__name__}: {str(err).strip()}"  # the builder's whole report (compiler output)
    return module, None


@contextlib.contextmanager
def exclusive_build(directory: str):
    """One process at a time in a kernel's build directory, by an advisory lock (`flock`) that the system releases
    when its holder ends, however it ends. PyTorch's builder has its own lock, a file that it waits on for as long as
    it exists — forever, where a build was killed — so the holder of ours removes one it finds: nobody else is
    building."""
    with open(os.path.join(directory, "k3.lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, "lock"))
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def summary(why: str) -> str:
    """The last line of a build failure's report (its cause, for one-line messages)."""
    lines = [line for line in why.splitlines() if line.strip()]
    return lines[-1].strip() if lines else why


def _build_directory(name: str, capability: str) -> str:
    """The kernel's own build directory (created)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    version = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}".replace("+", "_")
    path = os.path.join(root, f"k3_{name}_{capability.lower()}_{version}")
    os.makedirs(path, exist_ok=True)
    return path


def serves(name: str, *tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether kernel `name` takes a call on `tensors`: contiguous-able CPU tensors of `dtypes` (the kernel's: fp32
    unless it reads others) and of the plain types (a DTensor or another subclass: the torch ops), and the kernel
    built (the first refusal warns, see `load`)."""
    for t in tensors:  # a loop of cheap attribute reads: this runs before every decode-sized call
        if type(t) not in _PLAIN_TYPES or t.dtype not in dtypes or not t.is_cpu:
            return False
    return load(name) is not None


def rows(x: torch.Tensor) -> int:
    """How many rows x has over its last axis (what `MAX_ROWS` counts)."""
    return x.numel() // max(x.shape[-1], 1)


def hooked(*modules: torch.nn.Module) -> bool:
    """Whether a forward hook (global, or on one of `modules`) waits for a module call that a fused path would skip:
    such calls keep their modules."""
    return bool(_global_forward_hooks or _global_forward_pre_hooks
                or any(m._forward_hooks or m._forward_pre_hooks for m in modules))


def serves_few_rows(name: str, rows: int, *tensors: torch.Tensor,
                    dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether a few-row kernel takes a call: at most `MAX_ROWS` rows, no autograd, and `serves`."""
    return not torch.is_grad_enabled() and rows <= MAX_ROWS and serves(name, *tensors, dtypes=dtypes)


def load(name: str):
    """The compiled module `name`, or None where it could not be built (warned once, with the reason)."""
    module, why = build(name)
    if module is None:
        warnings.warn(f"the compiled {name} kernel is unavailable ({summary(why)}); the torch ops serve instead",
                      stacklevel=2)
    return module
