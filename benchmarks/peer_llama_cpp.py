"""Peer benchmark: k3 against llama.cpp's `kimi-k3` model on the CPU, same checkpoint, same thread count.

One k3 model directory (`save_pretrained` layout; default: a random-init k3-small, 226 M parameters, saved to a
temporary directory with a small BPE trained on docs/) is converted to GGUF by llama.cpp's own
`convert_hf_to_gguf.py` (cached next to the model as `ggml-model-<type>.gguf`). Its vocabulary step is replaced
(monkeypatched in a subprocess, the vendored converter is not edited): the converter recognises a tokenizer by
hashing a test string's ids, which a self-trained tiktoken vocabulary cannot match, so the wrapper writes the
vocabulary itself the way the converter does for Kimi K2 (gpt2-style byte-level tokens and merges from the
tiktoken ranks, pre-tokenizer `kimi-k2`, special slots as control tokens, unused ids as `[PAD<id>]`). Nothing else
is changed: the hyperparameters are the saved config.json's (its `max_position_embeddings` becomes
`kimi-k3.context_length`, which llama.cpp requires).

Before timing, the last-position logits of a few short prompts (tokenised by llama.cpp, `llama-debug
--save-logits`) are compared with k3's on the same ids: top-1 agreement and max |Δ| (when llama-debug is built).
A random-init model's sigmoid router scores lie close together, so a prompt whose 4th and 5th expert scores differ
by ~1e-6 can route differently in the two implementations (seen with k3-small: 3e-4 otherwise, ~1 then).

At each context depth d (--contexts, tokens already in the cache), in R rounds that alternate the two programs
(the machine's speed drifts by tens of percent over minutes; alternating lets a drift reach both alike):

* llama.cpp: `llama-bench -p P -n N -d d -t T -r 1 -o json` (pp: P tokens in one batch on top of d; tg: N tokens
  decoded one by one on top of d; its own warm-up run first);
* k3 (weights on 2 MiB pages, `k3.runtime.huge_page_weights`, as `k3 generate` loads them; `--small-pages`: not):
  the cache is filled to d once in chunks (decode.py's `Prefill`) and warmed up by one repetition; each round
  puts the cache back and runs P tokens in one call, then N greedy one-token decode steps as `generate` does.
  fp32, B=1, no_grad, torch with T threads.

Reported: the medians over the rounds (--rounds, default 5) of each side's tok/s, and ratio = the median (and the
range) of the per-round k3 / llama.cpp, each round's pair measured back to back at one context, llama.cpp first in
even rounds and k3 first in odd ones
(above 1: k3 faster). "CPU wait" is the share of wall time in which some task waited for a core (Linux PSI); well
above 0 % means other processes competed and the numbers are inflated.

Reproduce (llama.cpp as vendored by llama-cpp-python 0.3.36; the converter needs transformers 4.57.6,
pyyaml 6.0.3, huggingface-hub 0.36.0, tokenizers 0.22.1 beside the venv's torch/numpy/safetensors):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36   # the sdist; unpack it in /tmp/llcpp
    cmake -S /tmp/llcpp/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/llcpp/build -G Ninja \\
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
    cmake --build /tmp/llcpp/build -j2 --target llama-bench llama-debug
    pip install --target /tmp/llcpp/pydeps --no-deps transformers==4.57.6 pyyaml==6.0.3 huggingface-hub==0.36.0 \\
        tokenizers==0.22.1 filelock==3.20.0 packaging==25.0 fsspec==2025.10.0 typing-extensions==4.15.0
    PYTHONPATH=src .venv/bin/python benchmarks/peer_llama_cpp.py [--llama-cpp BUILD] [--model DIR] [--contexts 512 8192]
        [--quick] [--outtype f32|f16|q8_0]     # f16/q8_0 run llama-bench with --repack 0
"""

import argparse
import base64
import json
import math
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import CpuWait, machine, print_table
from decode import Prefill, restore, snapshot
from k3.config import K3Config
from k3.runtime import huge_page_weights
from k3.inference.generate import sample_next_token
from k3.model import K3ForCausalLM
from k3.tokenizer import K3Tokenizer, train_bpe

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BUILD = os.environ.get("K3_LLAMA_CPP", "/tmp/llcpp/build")
DEFAULT_PYDEPS = os.environ.get("K3_LLAMA_CPP_PYDEPS", "/tmp/llcpp/pydeps")
PROMPTS = ("The", "Hello world", "Mixture of experts", "def main():\n    return 42")  # for the logits check


# ------------------------------------------------------------------------------------ model and GGUF
def random_k3_small(path: Path) -> None:
    """A random-init k3-small with a 1,024-id BPE trained on docs/ (ids above it are unused by the text)."""
    torch.manual_seed(0)
    K3ForCausalLM(K3Config.from_preset("k3-small")).save_pretrained(path)
    texts = [p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("**/*.md"))]
    train_bpe(texts, 1024, num_special_slots=16).save(path)


def convert_in_subprocess(model_dir: str, outfile: str, outtype: str, src: str) -> None:
    """Run as `peer_llama_cpp.py --convert ...`: llama.cpp's converter with our own vocabulary step."""
    sys.path[:0] = [src, os.path.join(src, "gguf-py")]
    import gguf
    from conversion.kimi_k3 import KimiK3Model
    from conversion.qwen import QwenModel

    def set_vocab(self):
        path, n = self.dir_model / "tiktoken.model", self.hparams["vocab_size"]
        tok = K3Tokenizer.load(self.dir_model) if path.is_file() else None  # none: the 256 bytes only
        ranks = ({base64.b64decode(t): int(r) for t, r in map(str.split, path.read_text().splitlines())}
                 if tok else {bytes([b]): b for b in range(256)})
        tokens, types = [f"[PAD{i}]" for i in range(n)], [gguf.TokenType.UNUSED] * n
        for token, rank in ranks.items():
            tokens[rank], types[rank] = QwenModel.token_bytes_to_string(token), gguf.TokenType.NORMAL
        for name, i in (tok.special_tokens if tok else {}).items():
            tokens[i], types[i] = name, gguf.TokenType.CONTROL
        merges = [" ".join(map(QwenModel.token_bytes_to_string, pair)) for token, rank in ranks.items()
                  if len(token) > 1 and len(pair := QwenModel.bpe(ranks, token, max_rank=rank)) == 2]
        w = self.gguf_writer
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("kimi-k2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_add_bos_token(False)  # k3 adds none either
        for add, token_id in ((w.add_bos_token_id, tok and tok.bos_token_id),
                              (w.add_eos_token_id, tok and tok.eos_token_id)):
            if token_id is not None:
                add(token_id)

    KimiK3Model.set_vocab = set_vocab
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outfile", outfile, "--outtype", outtype]
    runpy.run_path(os.path.join(src, "convert_hf_to_gguf.py"), run_name="__main__")


def gguf_for(model_dir: Path, outtype: str, src: str, pydeps: str) -> Path:
    """The model as GGUF, converted unless an up-to-date one sits in the model directory."""
    out = model_dir / f"ggml-model-{outtype}.gguf"
    newest_input = max(p.stat().st_mtime for p in model_dir.iterdir() if p.suffix in (".json", ".safetensors", ".model"))
    if out.is_file() and out.stat().st_mtime > newest_input:
        return out
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pydeps, str(REPO / "src"), str(REPO / "benchmarks")]))
    print(f"Converting {model_dir} to {out.name} ...", flush=True)
    run = subprocess.run([sys.executable, __file__, "--convert", str(model_dir), str(out), outtype, src], env=env,
                         capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"conversion failed:\n{run.stderr[-3000:]}")
    return out


# --------------------------------------------------------------------------------------- measurements
@torch.no_grad()
def check_logits(model, gguf: Path, bin_dir: Path, threads: int, outtype: str = "f32") -> str:
    """Last-position logits of PROMPTS, llama.cpp (llama-debug) against k3 on llama.cpp's token ids.

    A quantised GGUF runs without weight repacking, as in llama_bench: with it, llama-debug aborts on a q8_0 k3
    GGUF (GGML_ASSERT(*cur_backend_id != -1) in ggml-backend.cpp, llama-cpp-python 0.3.36's llama.cpp)."""
    agree, diffs, scale = 0, [], 0.0
    with tempfile.TemporaryDirectory() as out:
        for prompt in PROMPTS:
            subprocess.run([bin_dir / "llama-debug", "-m", gguf, "-p", prompt, "--save-logits", "--logits-output-dir",
                            out, "-t", str(threads), "-c", "256"] + (["-nr"] if outtype != "f32" else []),
                           check=True, capture_output=True)
            theirs = torch.from_numpy(np.fromfile(f"{out}/llamacpp-{gguf.stem}.bin", np.float32))
            ids = torch.from_numpy(np.fromfile(f"{out}/llamacpp-{gguf.stem}-tokens.bin", np.int32)).long()
            ours = model(ids[None]).logits[0, -1].float()
            agree += int(ours.argmax() == theirs.argmax())
            diffs.append(f"{(ours - theirs).abs().max().item():.1e}")
            scale = max(scale, ours.abs().max().item())
    return (f"Logits, llama.cpp vs k3 (last position of {len(PROMPTS)} prompts tokenised by llama.cpp): top-1 agrees "
            f"{agree}/{len(PROMPTS)}, max |Δ| per prompt {', '.join(diffs)} (max |logit| {scale:.2f}; a random-init "
            "router can have near-tied experts, and one flipped choice shows as a Δ near the logit scale)")


def llama_bench(bin_dir: Path, gguf: Path, contexts, n_prompt, n_gen, reps, threads, outtype) -> dict:
    """{(depth, "pp" | "tg"): median tok/s} from one llama-bench run."""
    cmd = [bin_dir / "llama-bench", "-m", gguf, "-p", str(n_prompt), "-n", str(n_gen), "-d", ",".join(map(str, contexts)),
           "-t", str(threads), "-r", str(reps), "-o", "json"] + (["--repack", "0"] if outtype != "f32" else [])
    print("Running " + " ".join(map(str, cmd)), flush=True)
    results = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return {(r["n_depth"], "pp" if r["n_prompt"] else "tg"): statistics.median(r["samples_ts"]) for r in results}


class K3Speeds:
    """k3 on top of `depth` cached tokens: the cache is filled once; each `once()` puts it back and measures
    (prefill tok/s, decode tok/s)."""

    @torch.no_grad()
    def __init__(self, model, depth, n_prompt, n_gen):
        self.model, self.n_prompt, self.n_gen = model, n_prompt, n_gen
        self.ids_BT = torch.randint(0, model.config.vocab_size, (1, depth + n_prompt),
                                    generator=torch.Generator().manual_seed(0))
        self.cache = model.make_cache(1, capacity=depth + max(n_prompt, n_gen))
        Prefill(model, self.cache, self.ids_BT, budget_s=math.inf).to(depth)
        self.depth, self.start = depth, snapshot(self.cache)
        self.once()  # warm-up

    @torch.no_grad()
    def once(self) -> tuple[float, float]:
        model, cache = self.model, self.cache
        restore(cache, self.start)
        t0 = time.perf_counter()
        model(self.ids_BT[:, self.depth:], cache=cache)
        pp = self.n_prompt / (time.perf_counter() - t0)
        restore(cache, self.start)
        next_B, t0 = self.ids_BT[:, self.depth], time.perf_counter()
        for _ in range(self.n_gen):
            next_B = sample_next_token(model(next_B[:, None], cache=cache, validate=False).logits[:, -1], 0)
        return pp, self.n_gen / (time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------------ main
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", default=DEFAULT_BUILD, help=f"llama.cpp build dir (default {DEFAULT_BUILD}, "
                        "or $K3_LLAMA_CPP)")
    parser.add_argument("--pydeps", default=DEFAULT_PYDEPS, help="the converter's extra Python packages "
                        f"(default {DEFAULT_PYDEPS}, or $K3_LLAMA_CPP_PYDEPS)")
    parser.add_argument("--model", type=Path, help="a k3 model directory (default: random-init k3-small)")
    parser.add_argument("--contexts", type=int, nargs="+", help="context depths (default 512 8192; --quick 512)")
    parser.add_argument("--outtype", default="f32", choices=("f32", "f16", "q8_0"), help="GGUF type for llama.cpp")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="pp 64, tg 8, 1 repetition: checks the pipeline")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the full run (default 5)")
    parser.add_argument("--small-pages", action="store_true",
                        help="keep k3's weights on 4 KiB pages (default: k3.runtime.huge_page_weights, as k3 generate)")
    args = parser.parse_args()
    contexts = args.contexts or ([512] if args.quick else [512, 8192])
    n_prompt, n_gen, reps = (64, 8, 1) if args.quick else (512, 64, args.rounds)

    build = Path(args.llama_cpp)
    bin_dir, cmake_cache = build / "bin", build / "CMakeCache.txt"
    if not (bin_dir / "llama-bench").is_file() or not cmake_cache.is_file():
        sys.exit(f"no llama.cpp build at {build}: build it as in this script's docstring (cmake -S <llama.cpp> "
                 f"-B {build} -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF "
                 f"-DLLAMA_BUILD_TESTS=OFF; cmake --build {build} -j2 --target llama-bench llama-debug)")
    src = next(line.split("=", 1)[1].strip() for line in cmake_cache.read_text().splitlines()
               if line.startswith("CMAKE_HOME_DIRECTORY:"))
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = Path(tmp) / "k3-small-random"
            print("Building a random-init k3-small ...", flush=True)
            random_k3_small(model_dir)
        gguf = gguf_for(model_dir, args.outtype, src, args.pydeps)
        model = K3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        huge = not args.small_pages and huge_page_weights(model)  # as `k3 generate` does
        pages = "2 MiB pages" if huge else "4 KiB pages"
        n_params = sum(p.numel() for p in model.parameters()) / 1e6
        check = (check_logits(model, gguf, bin_dir, args.threads, args.outtype)
                 if (bin_dir / "llama-debug").is_file() else "Logits check skipped: llama-debug is not built")
        print(check, flush=True)

        start, cpu_wait = time.perf_counter(), CpuWait()
        ours = {depth: K3Speeds(model, depth, n_prompt, n_gen) for depth in contexts}
        runs = []  # per round: {(depth, "pp" | "tg"): (k3 tok/s, llama.cpp tok/s)}
        for r in range(reps):  # the two alternate per context, so a drift of the machine's speed reaches both alike;
            run = {}  # who goes first alternates too (what ran just before can slow a run down on a small VM)
            for depth, speeds in ours.items():
                if r % 2:
                    pp, tg = speeds.once()
                theirs = llama_bench(bin_dir, gguf, [depth], n_prompt, n_gen, 1, args.threads, args.outtype)
                if not r % 2:
                    pp, tg = speeds.once()
                run[depth, "pp"], run[depth, "tg"] = (pp, theirs[depth, "pp"]), (tg, theirs[depth, "tg"])
            runs.append(run)
        rows = []
        for depth in contexts:
            cells = []
            for kind, digits in (("pp", 1), ("tg", 2)):
                pairs = [run[depth, kind] for run in runs]
                ratios = [k / t for k, t in pairs]
                cells += [f"{statistics.median(k for k, _ in pairs):,.{digits}f}",
                          f"{statistics.median(t for _, t in pairs):,.{digits}f}",
                          f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"]
            rows.append([depth, *cells])

    print(f"\nMachine: {machine()}")
    print(f"Model: {model_dir} ({n_params:.1f} M parameters; k3's weights on {pages}); llama.cpp {src}, GGUF "
          f"{args.outtype}; {args.threads} "
          f"threads each; pp = {n_prompt} tokens in one batch, tg = {n_gen} decoded tokens, on top of the context; "
          f"{reps} rounds, each per context one llama-bench run (its own warm-up first) and one k3 repetition (k3 "
          f"warmed up before the first), llama.cpp first in even rounds, k3 in odd ones; medians over the rounds; ratio = median (range) of the per-round "
          f"k3 / llama.cpp")
    print(check + "\n")
    print_table(["context", "k3 prefill tok/s", "llama.cpp prefill tok/s", "ratio", "k3 decode tok/s",
                 "llama.cpp decode tok/s", "ratio"], rows, "rrrrrrr")
    print(f"Total runtime: {time.perf_counter() - start:.0f} s; load average at end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; CPU wait over the run: {cpu_wait} (PSI; "
          f"well above 0 % means other processes competed for the cores)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--convert"]:
        convert_in_subprocess(*sys.argv[2:6])
    else:
        main()
