"""The compiled training-path operations against the torch ops they replace, forward + backward, side by side.

At k3-tiny's training shapes (B×T = 8×256, width 128; 2 threads, fp32), alternating the two implementations in
rounds within one process, median ms per forward + backward of each; the ratio is torch ops / compiled:

* SiTU-GLU of the routed experts' hidden activation (8,192 × 96; `k3.ops.activation`) vs the §6.1 formula;
* RMSNorm with gain, and the L2 norm of KDA's q over heads of 32 (`k3.ops.norm`) vs their formulas;
* the Block AttnRes mix of 4 sources (`k3.ops.norm.normalized_key_mix`) vs the §5.1 formula;
* KDA's short convolution + SiLU over 3 packed documents per row (`k3.ops.kda.conv`) vs W shifted products.

    PYTHONPATH=src .venv/bin/python benchmarks/train_ops.py [--rounds 5]
"""

import argparse
import statistics
import time

import torch

from common import machine  # importing common keeps freed memory for reuse, as the k3 command does
from k3.ops.activation import situ_glu, situ_glu_reference
from k3.ops.kda import conv
from k3.ops.kda.conv import compiled_short_conv, short_conv
from k3.ops.norm import RMSNorm, l2_normalize, normalized_key_mix

B, T, D = 8, 256, 128


def norm_formula(x, w, eps, mean):
    ss = x.pow(2).mean(-1, keepdim=True) if mean else x.pow(2).sum(-1, keepdim=True)
    y = x * torch.rsqrt(ss + eps)
    return y if w is None else w * y


def mix_formula(query, *sources, eps=1e-5):
    logits = torch.stack([(V @ query) * torch.rsqrt(V.pow(2).mean(-1) + eps) for V in sources])
    return sum(p[..., None] * V for p, V in zip(torch.softmax(logits, 0), sources))


def fwd_bwd(fn, inputs):
    """A closure running fn on fresh leaves of `inputs` and the backward of the sum of its output."""
    def run():
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        fn(*leaves).sum().backward()
    return run


def cases():
    gen = torch.Generator().manual_seed(0)
    g, u = torch.randn(8192, 96, generator=gen), torch.randn(8192, 96, generator=gen)
    x, w = 3 * torch.randn(B, T, D, generator=gen), 1 + 0.3 * torch.randn(D, generator=gen)
    q = torch.randn(B, T, 4, 32, generator=gen)
    sources = [(0.05 * 10 ** (i % 3)) * torch.randn(B, T, D, generator=gen) + 0.1 * i for i in range(4)]
    query = 0.5 * torch.randn(D, generator=gen)
    conv_x, conv_w = torch.randn(B, T, D, generator=gen), 0.5 * torch.randn(D, 1, 4, generator=gen)
    docs = torch.cat([torch.full((B, n), i) for i, n in enumerate((100, 90, 66))], 1)

    def conv_reference(x, w):
        conv.compiled_short_conv = lambda *args: None
        try:
            return short_conv(x, w, None, docs)[0]
        finally:
            conv.compiled_short_conv = compiled_short_conv

    norm = RMSNorm(D, eps=1e-5)
    return {
        "SiTU-GLU 8,192×96": (fwd_bwd(lambda g, u: situ_glu_reference(g, u, 4.0, 25.0), [g, u]),
                              fwd_bwd(lambda g, u: situ_glu(g, u, 4.0, 25.0), [g, u])),
        "RMSNorm 2,048×128, gain": (fwd_bwd(lambda x, w: norm_formula(x, w, 1e-5, True), [x, w]),
                                    fwd_bwd(lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,)), [x, w])),
        "L2 norm 8,192×32": (fwd_bwd(lambda q: norm_formula(q, None, 1e-6, False), [q]), fwd_bwd(l2_normalize, [q])),
        "AttnRes mix, 4 sources of 2,048×128": (fwd_bwd(mix_formula, [query, *sources]),
                                                fwd_bwd(lambda qu, *s: normalized_key_mix(list(s), qu, 1e-5),
                                                        [query, *sources])),
        "short conv + SiLU 2,048×128, 3 documents a row": (fwd_bwd(conv_reference, [conv_x, conv_w]),
                                                            fwd_bwd(lambda x, w: short_conv(x, w, None, docs)[0],
                                                                    [conv_x, conv_w])),
    }


def median_ms(run, reps=20):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(machine())
    print("| operation (fwd + bwd) | torch ops ms | compiled ms | ratio |\n|---|---:|---:|---:|")
    for name, (reference, compiled) in cases().items():
        for run in (reference, compiled):  # warm-up
            run()
        ref_ms, ours_ms = [], []
        for _ in range(args.rounds):
            ref_ms.append(median_ms(reference))
            ours_ms.append(median_ms(compiled))
        r, o = statistics.median(ref_ms), statistics.median(ours_ms)
        print(f"| {name} | {r:.2f} | {o:.2f} | {r / o:.1f}× |", flush=True)


if __name__ == "__main__":
    main()
