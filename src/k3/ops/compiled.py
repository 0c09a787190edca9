"""The compiled CPU kernels (C++ beside the op that uses them), built with PyTorch's extension builder.

`load(name)` compiles `<name>_kernel.cpp` from this package on first use (g++, and ninja from the `ninja` package;
≈ 40 s per kernel) into PyTorch's per-user extension cache, per CPU capability (`-mavx2 -mfma` where PyTorch itself
runs AVX2 kernels), and returns the module; later processes load it from the cache. Where it cannot be built (no
compiler), `load` returns None and `available` warns once with the reason: every caller then keeps its torch ops.
`python -m k3.ops.build` builds them all ahead of time (`make` does, while installing).
"""

import functools
import os
import shutil
import sysconfig
import warnings

import torch

KERNELS = {  # name: source file, relative to this package
    "kda": os.path.join("kda", "cpu_kernel.cpp"),  # the chunkwise KDA core (k3.ops.kda.cpu, §3.12)
    "matvec": "matvec_kernel.cpp",  # few-row products of decoding (k3.ops.matvec)
    "activation": "activation_kernel.cpp",  # SiTU-GLU in one pass each way (k3.ops.activation)
}
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
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), KERNELS[name])
    try:
        from torch.utils.cpp_extension import load as load_extension

        module = load_extension(name=f"k3_{name}_{capability.lower()}", sources=[source], extra_cflags=flags,
                                extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # no compiler, no ninja, a failed build: the torch ops serve every call
        return None, f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
    return module, None


def load(name: str):
    """The compiled module `name`, or None where it could not be built (warned once, with the reason)."""
    module, why = build(name)
    if module is None:
        warnings.warn(f"the compiled {name} kernel is unavailable ({why}); the torch ops serve instead", stacklevel=2)
    return module
