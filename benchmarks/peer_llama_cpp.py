"""Peer benchmark: k3 against llama.cpp's `kimi-k3` model on the CPU, same checkpoint, same thread count, at
matched weight formats.

One k3 model directory (`save_pretrained` layout; default: a random-init k3-small, 226 M parameters, saved to a
temporary directory with a small BPE trained on docs/) is converted to GGUF by llama.cpp's own
`convert_hf_to_gguf.py` (cached next to the model as `ggml-model-<type>.gguf`). Its vocabulary step is replaced
(monkeypatched in a subprocess, the vendored converter is not edited): the converter recognises a tokenizer by
hashing a test string's ids, which a self-trained tiktoken vocabulary cannot match, so the wrapper writes the
vocabulary itself the way the converter does for Kimi K2 (gpt2-style byte-level tokens and merges from the
tiktoken ranks, pre-tokenizer `kimi-k2`, special slots as control tokens, unused ids as `[PAD<id>]`). Nothing else
is changed: the hyperparameters are the saved config.json's.

Formats (--formats), each a pair of the same weights in one form on both sides:

* f32: k3 fp32 against GGUF F32;
* bf16: k3 bf16 (the model loaded with `dtype=torch.bfloat16`; the §0.4 tensors stay fp32) against GGUF BF16;
* f16: the same k3 bf16 model against GGUF F16 (k3 has no fp16 kernels; fp16 and bf16 weights are the same bytes);
* mxfp4: k3 with its routed experts packed in MXFP4 (`from_pretrained(..., experts="mxfp4")`, bf16 elsewhere)
  against the F32 GGUF quantised by `llama-quantize --tensor-type _exps=mxfp4 --tensor-type .=bf16 ... Q8_0`:
  MXFP4 routed experts, BF16 everywhere else (the override keeps no tensor at the Q8_0 base type).

Each k3 form runs in a process of its own (so its peak RSS is its own); llama.cpp runs as `llama-bench`, whose
peak RSS is read from the kernel when it exits (wait4). Both peaks include the caches of the deepest context and
the working memory of filling them; k3's resident size right after loading (weights, torch) is printed beside its
peak.

Before timing, the last-position logits of a few short prompts (tokenised by llama.cpp, `llama-debug
--save-logits`) are compared with k3's on the same ids, per format: top-1 agreement and max |Δ|. A random-init
model's sigmoid router scores lie close together, so a prompt whose 4th and 5th expert scores differ by ~1e-6 can
route differently in the two implementations (one flipped choice shows as a Δ near the logit scale).

At each context depth d (--contexts, tokens already in the cache), in R rounds that alternate the two programs
(the machine's speed drifts by tens of percent over minutes; alternating lets a drift reach both alike):

* llama.cpp: `llama-bench -p P -n N -d d -t T -r 1 -o json` (pp: P tokens in one batch on top of d; tg: N tokens
  decoded one by one on top of d; its own warm-up run first; weight repacking on, llama-bench's default, except
  for F16, where it aborts as llama-debug does below);
* k3 (weights on 2 MiB pages, `k3.runtime.huge_page_weights`, as `k3 generate` loads them): the cache is filled to
  d once in chunks (decode.py's `Prefill`) and warmed up by one repetition; each round puts the cache back and
  runs P tokens in one call, then N greedy one-token decode steps as `generate` does. B=1, no_grad, T threads.

Reported per format and context: the medians over the rounds of each side's tok/s, and ratio = the median (and the
range) of the per-round k3 / llama.cpp, each round's pair measured back to back, llama.cpp first in even rounds and
k3 first in odd ones (above 1: k3 faster). "CPU wait" is the share of wall time in which some task waited for a
core (Linux PSI); well above 0 % means other processes competed and the numbers are inflated.

Reproduce (llama.cpp as vendored by llama-cpp-python 0.3.36; the converter needs transformers 4.57.6,
pyyaml 6.0.3, huggingface-hub 0.36.0, tokenizers 0.22.1 beside the venv's torch/numpy/safetensors):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36   # the sdist; unpack it in /tmp/llcpp
    cmake -S /tmp/llcpp/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/llcpp/build -G Ninja \\
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    cmake --build /tmp/llcpp/build -j2 --target llama-bench llama-debug llama-quantize llama-server
    pip install --target /tmp/llcpp/pydeps --no-deps transformers==4.57.6 pyyaml==6.0.3 huggingface-hub==0.36.0 \\
        tokenizers==0.22.1 filelock==3.20.0 packaging==25.0 fsspec==2025.10.0 typing-extensions==4.15.0
    PYTHONPATH=src .venv/bin/python benchmarks/peer_llama_cpp.py [--llama-cpp BUILD] [--model DIR]
        [--formats f32 bf16 f16 mxfp4] [--contexts 512 8192] [--rounds 3] [--quick]
"""

import argparse
import base64
import dataclasses
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
from k3.runtime import huge_page_weights, peak_rss_gib
from k3.inference.compiled_step import decode_one_token
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


def mxfp4_gguf(f32_gguf: Path, bin_dir: Path) -> Path:
    """The F32 GGUF with MXFP4 routed experts and BF16 elsewhere (llama-quantize), cached beside it."""
    out = f32_gguf.with_name("ggml-model-mxfp4-experts-bf16.gguf")
    if out.is_file() and out.stat().st_mtime > f32_gguf.stat().st_mtime:
        return out
    print(f"Quantising {f32_gguf.name} to {out.name} ...", flush=True)
    run = subprocess.run([bin_dir / "llama-quantize", "--tensor-type", "_exps=mxfp4", "--tensor-type", ".=bf16",
                          f32_gguf, out, "Q8_0"], capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"llama-quantize failed:\n{run.stderr[-3000:]}")
    return out


@dataclasses.dataclass(frozen=True)
class Format:
    """One weight format on both sides: how k3 loads the model, which GGUF llama.cpp runs."""
    dtype: torch.dtype
    experts: str  # k3's routed experts: "dense" or "mxfp4"
    gguf: str  # the converter's --outtype, or "mxfp4" (quantised from the f32 GGUF)
    label: str
    repack: bool = True  # llama-bench's weight repacking (its default)

    def gguf_path(self, model_dir: Path, src: str, pydeps: str, bin_dir: Path) -> Path:
        if self.gguf == "mxfp4":
            return mxfp4_gguf(gguf_for(model_dir, "f32", src, pydeps), bin_dir)
        return gguf_for(model_dir, self.gguf, src, pydeps)


FORMATS = {
    "f32": Format(torch.float32, "dense", "f32", "k3 fp32 vs GGUF F32"),
    "bf16": Format(torch.bfloat16, "dense", "bf16", "k3 bf16 vs GGUF BF16"),
    "f16": Format(torch.bfloat16, "dense", "f16", "k3 bf16 vs GGUF F16", repack=False),  # with it: the abort above
    "mxfp4": Format(torch.bfloat16, "mxfp4", "mxfp4", "k3 MXFP4 experts + bf16 vs GGUF MXFP4 experts + BF16"),
}


# --------------------------------------------------------------------------------------- measurements
@torch.no_grad()
def check_logits(model, gguf: Path, bin_dir: Path, threads: int) -> str:
    """Last-position logits of PROMPTS, llama.cpp (llama-debug) against k3 on llama.cpp's token ids.

    llama-debug runs without weight repacking (`-nr`): with it, it aborts on a non-f32 k3 GGUF
    (GGML_ASSERT(*cur_backend_id != -1) in ggml-backend.cpp, llama-cpp-python 0.3.36's llama.cpp)."""
    agree, diffs, scale = 0, [], 0.0
    with tempfile.TemporaryDirectory() as out:
        for prompt in PROMPTS:
            subprocess.run([bin_dir / "llama-debug", "-m", gguf, "-p", prompt, "--save-logits", "--logits-output-dir",
                            out, "-t", str(threads), "-c", "256", "-nr"], check=True, capture_output=True)
            theirs = torch.from_numpy(np.fromfile(f"{out}/llamacpp-{gguf.stem}.bin", np.float32))
            ids = torch.from_numpy(np.fromfile(f"{out}/llamacpp-{gguf.stem}-tokens.bin", np.int32)).long()
            ours = model(ids[None]).logits[0, -1].float()
            agree += int(ours.argmax() == theirs.argmax())
            diffs.append(f"{(ours - theirs).abs().max().item():.1e}")
            scale = max(scale, ours.abs().max().item())
    return f"top-1 {agree}/{len(PROMPTS)}, max |Δ| {', '.join(diffs)} (max |logit| {scale:.2f})"


def llama_bench(bin_dir: Path, gguf: Path, depth, n_prompt, n_gen, threads, repack) -> tuple[dict, float]:
    """({"pp" | "tg": tok/s}, peak RSS in GiB) of one llama-bench run (one repetition after its warm-up). The peak
    is the kernel's ru_maxrss, which counts the forking process's peak too: this one's (≈ 0.3 GiB) is below
    llama-bench's."""
    cmd = [bin_dir / "llama-bench", "-m", gguf, "-p", str(n_prompt), "-n", str(n_gen), "-d", str(depth),
           "-t", str(threads), "-r", "1", "-o", "json", "--repack", str(int(repack))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.exit(f"{' '.join(map(str, cmd))} failed with exit code {proc.returncode}")
    speeds = {"pp" if r["n_prompt"] else "tg": statistics.median(r["samples_ts"]) for r in json.loads(out)}
    return speeds, usage.ru_maxrss / 2**20


class K3Speeds:
    """k3 on top of `depth` cached tokens: the cache is filled once; each `once()` puts it back and measures
    {"pp": prefill tok/s, "tg": decode tok/s}."""

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
    def once(self) -> dict:
        model, cache = self.model, self.cache
        restore(cache, self.start)
        t0 = time.perf_counter()
        model(self.ids_BT[:, self.depth:], cache=cache)
        pp = self.n_prompt / (time.perf_counter() - t0)
        restore(cache, self.start)
        next_B, t0 = self.ids_BT[:, self.depth], time.perf_counter()
        for _ in range(self.n_gen):
            next_B = sample_next_token(decode_one_token(model, next_B[:, None], cache)[:, -1], 0)
        return {"pp": pp, "tg": self.n_gen / (time.perf_counter() - t0)}


# ------------------------------------------------------------------------ k3 in a process per format
REPLY = "@k3 "  # marks the worker's answers among whatever else reaches its stdout


def worker(model_dir: str, fmt: str, gguf: str, bin_dir: str, threads: str, contexts: str, n_prompt: str, n_gen: str):
    """Run as `peer_llama_cpp.py --worker ...`: load one format, check its logits, fill the caches, then answer
    `<depth>` with one measurement and `rss` with the peak RSS (GiB), one JSON line each."""
    torch.set_num_threads(int(threads))
    spec = FORMATS[fmt]
    model = K3ForCausalLM.from_pretrained(model_dir, dtype=spec.dtype, experts=spec.experts).eval()
    huge = huge_page_weights(model)  # as `k3 generate` does
    loaded_rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    answer = {"check": check_logits(model, Path(gguf), Path(bin_dir), int(threads)), "huge_pages": huge,
              "params_M": sum(p.numel() for p in model.parameters()) / 1e6, "loaded_rss": loaded_rss}
    speeds = {int(d): K3Speeds(model, int(d), int(n_prompt), int(n_gen)) for d in contexts.split(",")}
    print(REPLY + json.dumps(answer), flush=True)
    for line in sys.stdin:
        if line.strip() == "rss":
            answer = {"rss": peak_rss_gib()}
        else:
            answer = speeds[int(line)].once()
        print(REPLY + json.dumps(answer), flush=True)


class Worker:
    """The parent's handle on one worker process."""

    def __init__(self, *args):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO / "benchmarks")]))
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", *map(str, args)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._reply()

    def ask(self, request) -> dict:
        self.proc.stdin.write(f"{request}\n")
        self.proc.stdin.flush()
        return self._reply()

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        sys.exit(f"a k3 worker exited with code {self.proc.wait()}")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# ------------------------------------------------------------------------------------------------ main
def model_directory(model: Path | None, tmp: str, build=random_k3_small) -> Path:
    """`model` (--model), or a random-init k3-small that `build` writes into `tmp`."""
    if model is not None:
        return model
    path = Path(tmp) / "k3-small-random"
    print("Building a random-init k3-small ...", flush=True)
    build(path)
    return path


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """The options naming llama.cpp's build, the converter's packages and the model (also benchmarks/serve.py's)."""
    parser.add_argument("--llama-cpp", default=DEFAULT_BUILD, help=f"llama.cpp build dir (default {DEFAULT_BUILD}, "
                        "or $K3_LLAMA_CPP)")
    parser.add_argument("--pydeps", default=DEFAULT_PYDEPS, help="the converter's extra Python packages "
                        f"(default {DEFAULT_PYDEPS}, or $K3_LLAMA_CPP_PYDEPS)")
    parser.add_argument("--model", type=Path, help="a k3 model directory (default: random-init k3-small)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_peer_arguments(parser)
    parser.add_argument("--formats", nargs="+", choices=tuple(FORMATS), help="weight formats (default: all)")
    parser.add_argument("--contexts", type=int, nargs="+", help="context depths (default 512 8192; --quick 512)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="pp 64, tg 8, 1 round: checks the pipeline")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the full run (default 3)")
    args = parser.parse_args()
    contexts = args.contexts or ([512] if args.quick else [512, 8192])
    formats = args.formats or list(FORMATS)
    n_prompt, n_gen, rounds = (64, 8, 1) if args.quick else (512, 64, args.rounds)

    build = Path(args.llama_cpp)
    bin_dir, cmake_cache = build / "bin", build / "CMakeCache.txt"
    tools = ["llama-bench", "llama-debug"] + (["llama-quantize"] if "mxfp4" in formats else [])
    missing = [tool for tool in tools if not (bin_dir / tool).is_file()]
    if missing or not cmake_cache.is_file():
        sys.exit(f"no llama.cpp build with {', '.join(tools)} at {build}: build it as in this script's docstring")
    src = next(line.split("=", 1)[1].strip() for line in cmake_cache.read_text().splitlines()
               if line.startswith("CMAKE_HOME_DIRECTORY:"))

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_directory(args.model, tmp)
        ggufs = {f: FORMATS[f].gguf_path(model_dir, src, args.pydeps, bin_dir) for f in formats}
        workers = {}
        for f in formats:
            print(f"Loading k3 ({f}), checking its logits and filling its caches ...", flush=True)
            workers[f] = Worker(model_dir, f, ggufs[f], bin_dir, args.threads, ",".join(map(str, contexts)),
                                n_prompt, n_gen)

        start, cpu_wait = time.perf_counter(), CpuWait()
        runs, their_rss = [], dict.fromkeys(formats, 0.0)  # runs: per round {(format, depth, kind): (k3, llama.cpp)}
        for r in range(rounds):  # who goes first alternates (what ran just before can slow a run down on a small VM)
            run = {}
            for f in formats:
                for depth in contexts:
                    if r % 2:
                        ours = workers[f].ask(depth)
                    theirs, rss = llama_bench(bin_dir, ggufs[f], depth, n_prompt, n_gen, args.threads,
                                              FORMATS[f].repack)
                    if not r % 2:
                        ours = workers[f].ask(depth)
                    their_rss[f] = max(their_rss[f], rss)
                    for kind in ("pp", "tg"):
                        run[f, depth, kind] = ours[kind], theirs[kind]
            runs.append(run)
            print(f"round {r + 1}/{rounds} done", flush=True)
        our_rss = {f: workers[f].ask("rss")["rss"] for f in formats}
        for w in workers.values():
            w.close()

    rows = []
    for f in formats:
        for depth in contexts:
            cells = []
            for kind, digits in (("tg", 2), ("pp", 1)):
                pairs = [run[f, depth, kind] for run in runs]
                ratios = [k / t for k, t in pairs]
                cells += [f"{statistics.median(k for k, _ in pairs):,.{digits}f}",
                          f"{statistics.median(t for _, t in pairs):,.{digits}f}",
                          f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"]
            rows.append([FORMATS[f].label, f"{depth:,}", *cells])
    print(f"\nMachine: {machine()}")
    print(f"Model: {model_dir} ({workers[formats[0]].ready['params_M']:.1f} M parameters); llama.cpp {src}; "
          f"{args.threads} threads each; pp = {n_prompt} tokens in one batch, tg = {n_gen} decoded tokens, on top of "
          f"the context; {rounds} rounds; medians over the rounds; ratio = median (range) of the per-round "
          f"k3 / llama.cpp")
    for f in formats:
        ready = workers[f].ready
        print(f"{FORMATS[f].label}: GGUF {ggufs[f].name}; k3 weights on {'2 MiB' if ready['huge_pages'] else '4 KiB'} "
              f"pages; logits on {len(PROMPTS)} prompts: {ready['check']}; peak RSS k3 {our_rss[f]:.2f} GiB (resident "
              f"after loading {ready['loaded_rss']:.2f} GiB), llama.cpp {their_rss[f]:.2f} GiB")
    print()
    print_table(["format", "context", "k3 decode tok/s", "llama.cpp decode tok/s", "ratio", "k3 prefill tok/s",
                 "llama.cpp prefill tok/s", "ratio"], rows, "llrrrrrr")
    print(f"Total runtime: {time.perf_counter() - start:.0f} s; load average at end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; CPU wait over the run: {cpu_wait} (PSI; "
          f"well above 0 % means other processes competed for the cores)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--convert"]:
        convert_in_subprocess(*sys.argv[2:6])
    elif sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:10])
    else:
        main()
