"""Serving benchmark: `k3 serve` against llama.cpp's `llama-server`, same checkpoint, concurrent streaming clients.

One k3 model directory (--model; default: peer_llama_cpp.py's random-init k3-small, 226 M parameters, with the
tokenizer below) is served in fp32 by k3 and as its GGUF F32 (converted as peer_llama_cpp.py does, cached next to
the model) by llama.cpp. One server runs at a time, bound to 127.0.0.1, on T threads (--threads):

* `python -m k3 serve MODEL --max-batch 16 --max-context C` (torch on T threads; otherwise its defaults: prefill
  chunk 256, prefix cache 1,024 MiB);
* `llama-server -m GGUF -np 16 -c 16·C -t T -tb T --cont-batching --no-webui`: 16 slots of C positions each (one KV
  cache per slot, its default when -np is given), otherwise its defaults (prompt caching on).

C is the smallest power of two that holds the longest request of the run.

Every request is a streamed `/v1/completions` whose prompt is a list of token ids (both servers take one, so both
see the same ids), at temperature 0, with `max_tokens` M; llama-server also gets `ignore_eos: true`. k3 has no such
switch: a request ends early where greedy decoding picks one of its stop ids (<|end_of_msg|>, [EOS]), so the
generated tokens are counted from each stream's `usage` and requests that ended early are reported. Per request the
client records the time to the first chunk carrying text (TTFT) and the gaps between such chunks (ITL).

Workloads, in this order, on each server after one warm-up request:

* N concurrent clients for each N of --clients: each client sends --requests requests one after another, each with
  64 random token ids of its own (no two prompts share a prefix, so no server reuses a cached one) and
  M = --max-tokens; aggregate tok/s = all tokens generated / the workload's wall time;
* prefix caching: 4 clients, each sending --prefix-requests requests of one shared P-token prefix (--prefix, a
  multiple of k3's prefill chunk, so k3 can reuse all of it) and 16 ids of their own, M = 16, after one request with
  the prefix (so it is warm). k3 runs it twice: with its prefix cache (the default) and, in a server of its own, with
  `--prefix-cache-mib 0`; llama-server with `cache_prompt: true` (its default). Reported: TTFT, and the prompt
  tokens each server says it took from a cache (`usage.prompt_tokens_details.cached_tokens`).

Rounds (--rounds) alternate the order of the servers, llama.cpp first in even rounds and k3 first in odd ones, so a
drift of the machine's speed reaches both alike. Reported: tok/s as the median over the rounds, ratio = the median
(and range) of the per-round k3 / llama.cpp (above 1: k3 faster), TTFT and ITL percentiles over the requests and gaps
of all rounds together. "CPU wait" is the share of wall time in which some task waited for a core (Linux PSI), over
the run and (in the progress lines and the JSON) per workload: a server's threads beyond T (k3's HTTP event loop,
llama-server's HTTP threads) and this client's add some, but well above 0 % means other processes competed.

The default model's tokenizer: random_k3_small's covers only ids below 1,024 of the model's 32,768 (k3 would sample
among those only; llama.cpp among all). It is replaced by one in which every id decodes to whole text (printable
ASCII pairs and triples after the 256 single bytes; the 16 special slots of `k3 init`'s tokenizer), so that both
servers sample over the same ids and a stream chunk carries one token: both servers hold back a token's text while
it ends in an incomplete UTF-8 character, which `k3 init`'s byte-pair tokens would do for a quarter to a half of the
tokens, merging them into the next chunk. The ratio of text chunks to generated tokens is printed.

Reproduce: build llama.cpp and install the converter's packages as in peer_llama_cpp.py's docstring (its build
includes `llama-server`; `-DLLAMA_USE_PREBUILT_UI=OFF` keeps the server's web UI from being fetched), then

    PYTHONPATH=src .venv/bin/python benchmarks/serve.py [--llama-cpp BUILD] [--model DIR] [--clients 1 4 16]
        [--max-tokens 128] [--requests 2] [--prefix 2048] [--prefix-requests 4] [--rounds 3] [--threads 2]
        [--k3-only] [--json PATH] [--quick]
"""

import argparse
import contextlib
import http.client
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from common import CpuWait, machine, print_table
from k3.config import K3Config
from k3.tokenizer import K3Tokenizer, byte_pair_tokenizer
from peer_llama_cpp import REPO, add_peer_arguments, gguf_for, model_directory, random_k3_small

SLOTS = 16  # k3's --max-batch, llama-server's -np
PROMPT_TOKENS = 64  # the throughput workloads' prompts
PREFIX_CLIENTS, SUFFIX_TOKENS, PREFIX_MAX_TOKENS = 4, 16, 16  # the prefix workload
WARMUP_MAX_TOKENS = 8
START_TIMEOUT_S, REQUEST_TIMEOUT_S, STOP_TIMEOUT_S = 120, 300, 15
K3, K3_NO_CACHE, LLAMA = "k3", "k3, prefix cache off", "llama.cpp"


# ------------------------------------------------------------------------------------------ model
def whole_text_tokenizer(vocab_size: int) -> K3Tokenizer:
    """A tokenizer for all `vocab_size` ids of a random-init model whose every BPE token past the 256 single bytes is
    2 or 3 printable ASCII characters (pairs, then triples, in order: each merges two lower ranks), with the special
    slots of `byte_pair_tokenizer` (what `k3 init` writes)."""
    specials = byte_pair_tokenizer(vocab_size).special_tokens
    printable = [bytes([c]) for c in range(32, 127)]
    longer = itertools.chain(itertools.product(printable, repeat=2), itertools.product(printable, repeat=3))
    n_longer = vocab_size - len(specials) - 256
    ranks = [bytes([b]) for b in range(256)] + [b"".join(t) for t in itertools.islice(longer, n_longer)]
    return K3Tokenizer({token: rank for rank, token in enumerate(ranks)}, specials)


def default_model(path: Path) -> None:
    random_k3_small(path)
    whole_text_tokenizer(K3Config.from_json(path).vocab_size).save(path)


# ----------------------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def running(label: str, cmd: list, env: dict | None, log_path: Path):
    """A server process (`cmd`, which binds 127.0.0.1 and `--port`) once it answers /health with 200; yields
    (process, port). It is stopped on leaving, whatever happened (SIGTERM, SIGKILL after STOP_TIMEOUT_S)."""
    port = cmd[cmd.index("--port") + 1]
    with open(log_path, "w") as log:  # its own session: a Ctrl-C reaches this script, which then stops it
        proc = subprocess.Popen(list(map(str, cmd)), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{label}: the server exited with code {proc.returncode} while starting; its log "
                                   f"ends:\n{log_tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: the server was not ready after {START_TIMEOUT_S} s; its log ends:\n"
                                   f"{log_tail(log_path)}")
            if health(port) == 200:  # k3 listens before its model has loaded; llama-server answers 503 meanwhile
                break
            time.sleep(0.5)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def health(port: int) -> int | None:
    """The status of GET /health, None without an answer within 2 s."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


def peak_rss_gib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20


# ----------------------------------------------------------------------------------------- clients
def stream(port: int, body: dict) -> dict:
    """One streamed completion: TTFT, the gaps between chunks carrying text, and the server's token counts."""
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        start, times, usage = time.perf_counter(), [], None
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"port {port}: HTTP {response.status}: {response.read()[:500].decode(errors='replace')}")
        while (remaining := deadline - time.monotonic()) > 0:  # until [DONE] or the end of the stream
            conn.sock.settimeout(remaining)  # the whole request's deadline bounds each read
            line = response.readline()
            now = time.perf_counter()
            if not line or line.strip() == b"data: [DONE]":
                break
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[len(b"data: "):])
            if "error" in chunk:
                raise RuntimeError(f"port {port}: error in the stream: {chunk['error']}")
            if any(choice.get("text") for choice in chunk.get("choices", ())):
                times.append(now)
            usage = chunk.get("usage") or usage
        else:
            raise TimeoutError(f"port {port}: a request took over {REQUEST_TIMEOUT_S} s")
    finally:
        conn.close()
    if not times or usage is None:
        raise RuntimeError(f"port {port}: a stream without {'text' if not times else 'usage'}")
    return {"ttft_s": times[0] - start, "itl_s": np.diff(times).tolist(), "tokens": usage["completion_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), "chunks": len(times)}


def workload(port: int, extra: dict, prompts: list[list[list[int]]], max_tokens: int) -> dict:
    """`prompts[c]`: client c's requests, sent one after another; the clients run concurrently, a thread each."""
    done: list = [None] * len(prompts)

    def one_client(c: int) -> None:
        try:
            done[c] = [stream(port, {"prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                                     "stream_options": {"include_usage": True}, **extra}) for ids in prompts[c]]
        except Exception as e:  # raised again below, in the main thread
            done[c] = e

    threads = [threading.Thread(target=one_client, args=(c,), daemon=True) for c in range(len(prompts))]
    cpu_wait, start = CpuWait(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall_s = time.perf_counter() - start
    for client_requests in done:
        if isinstance(client_requests, Exception):
            raise client_requests
    requests = [r for client_requests in done for r in client_requests]
    return {"wall_s": wall_s, "tokens": sum(r["tokens"] for r in requests), "max_tokens": max_tokens,
            "cpu_wait": str(cpu_wait), "requests": requests}


def token_ids(seed: int, clients: int, per_client: int, length: int, n_ids: int, prefix=()) -> list:
    """Per client, `per_client` prompts of `prefix` + `length` random ids below `n_ids` (the same for every server)."""
    rng = np.random.default_rng(seed)
    return [[[*prefix, *rng.integers(0, n_ids, length).tolist()] for _ in range(per_client)] for _ in range(clients)]


def serve_once(label: str, cmd: list, env: dict | None, extra: dict, plan: dict, log_dir: Path) -> dict:
    """Start one server, run `plan` (name: (prompts, max_tokens), in order), stop it."""
    start = time.perf_counter()
    with running(label, cmd, env, log_dir / f"{label.replace(', ', '-').replace(' ', '-')}.log") as (proc, port):
        result = {"load_s": time.perf_counter() - start, "workloads": {}}
        for name, (prompts, max_tokens) in plan.items():
            w = result["workloads"][name] = workload(port, extra, prompts, max_tokens)
            print(f"  {label}, {name}: {w['tokens'] / w['wall_s']:.1f} tok/s, TTFT p50 "
                  f"{1e3 * statistics.median(r['ttft_s'] for r in w['requests']):.0f} ms, CPU wait {w['cpu_wait']}",
                  flush=True)
        result["peak_rss_gib"] = peak_rss_gib(proc.pid)
    return result


# ------------------------------------------------------------------------------------------ report
def pooled(results: list, label: str, name: str) -> dict:
    """One server's workload over all rounds: per-round tok/s, TTFT and ITL percentiles (ms) of all requests."""
    runs = [r[label]["workloads"][name] for r in results]
    requests = [q for w in runs for q in w["requests"]]
    gaps = [g for q in requests for g in q["itl_s"]]
    return {"tok_s": [w["tokens"] / w["wall_s"] for w in runs],
            "ttft": np.percentile([q["ttft_s"] for q in requests], [50, 99]) * 1e3,
            "itl": np.percentile(gaps, [50, 99]) * 1e3 if gaps else (np.nan, np.nan),
            "cached": statistics.mean(q["cached_tokens"] for q in requests),
            "short": sum(q["tokens"] < w["max_tokens"] for w in runs for q in w["requests"]),
            "requests": len(requests), "chunks": sum(q["chunks"] for q in requests),
            "tokens": sum(q["tokens"] for q in requests)}


def p50_p99(ms) -> str:
    return f"{ms[0]:,.0f} / {ms[1]:,.0f}"


def ratio(ours: list, theirs: list) -> str:
    per_round = [k / t for k, t in zip(ours, theirs)]
    return f"{statistics.median(per_round):.2f} ({min(per_round):.2f}–{max(per_round):.2f})"


def report(results: list, sides: list, clients: list, settings: dict) -> None:
    """The two Markdown tables and their notes."""
    stats = {(side, n): pooled(results, side, f"{n} clients") for side in sides for n in clients}
    tok_s = {key: statistics.median(s["tok_s"]) for key, s in stats.items()}
    columns = ["clients", *(f"{side} tok/s" for side in sides)] + (["ratio"] if LLAMA in sides else [])
    columns += [f"{side} {metric} p50 / p99 (ms)" for metric in ("TTFT", "ITL") for side in sides]
    rows = []
    for n in clients:
        row = [n, *(f"{tok_s[side, n]:,.1f}" for side in sides)]
        if LLAMA in sides:
            row.append(ratio(stats[K3, n]["tok_s"], stats[LLAMA, n]["tok_s"]))
        rows.append(row + [p50_p99(stats[side, n][metric]) for metric in ("ttft", "itl") for side in sides])
    print(f"Throughput: N clients, each sending {settings['requests']} streamed request(s) one after another "
          f"({PROMPT_TOKENS} prompt tokens, {settings['max_tokens']} generated); tok/s = all generated tokens / wall "
          f"time, median over {len(results)} round(s)"
          f"{'; ratio = k3 / llama.cpp, median (range) of the rounds' if LLAMA in sides else ''}\n")
    print_table(columns, rows, "r" * len(columns))
    lo, hi = min(clients), max(clients)
    scaling = ", ".join(f"{side} {tok_s[side, hi] / tok_s[side, lo]:.2f}×" for side in sides)
    print(f"Aggregate tok/s at {hi} clients over {lo}: {scaling} (k3's target: ≥ 4×)")
    for side in sides:
        short, n_requests, chunks, tokens = (sum(stats[side, n][key] for n in clients)
                                             for key in ("short", "requests", "chunks", "tokens"))
        print(f"{side}: {short} of {n_requests} requests ended before max_tokens; {chunks / tokens:.3f} text chunks "
              "per generated token")

    print(f"\nPrefix caching: {PREFIX_CLIENTS} clients, each sending {settings['prefix_requests']} requests of a "
          f"shared {settings['prefix']:,}-token prefix + {SUFFIX_TOKENS} tokens of their own ({PREFIX_MAX_TOKENS} "
          f"generated), the prefix warm; {len(results)} round(s)\n")
    prefix = {side: pooled(results, side, "prefix") for side in (K3, K3_NO_CACHE, LLAMA) if side in results[0]}
    print_table(["server", "TTFT p50 / p99 (ms)", "prompt tokens from a cache (mean per request)"],
                [[side, p50_p99(s["ttft"]), f"{s['cached']:,.0f}"] for side, s in prefix.items()], "lrr")
    speedup = prefix[K3_NO_CACHE]["ttft"][0] / prefix[K3]["ttft"][0]
    print(f"k3's TTFT p50 without its prefix cache over with it: {speedup:.1f}×")


# -------------------------------------------------------------------------------------------- main
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_peer_arguments(parser)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16],
                        help="concurrent clients (default 1 4 16)")
    parser.add_argument("--max-tokens", type=int, help="tokens generated per request (default 128; --quick 32)")
    parser.add_argument("--requests", type=int, help="requests per client (default 2; --quick 1)")
    parser.add_argument("--prefix", type=int, help="shared prefix tokens (default 2048; --quick 512; k3 "
                        "reuses whole prefill chunks of 256)")
    parser.add_argument("--prefix-requests", type=int, help="prefix requests per client (default 4; --quick 2)")
    parser.add_argument("--rounds", type=int, help="rounds (default 3; --quick 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k3-only", action="store_true", help="no llama-server")
    parser.add_argument("--json", type=Path, help="write all raw numbers here")
    parser.add_argument("--quick", action="store_true", help="32 tokens, 1 request per client, a 512-token prefix, "
                        "1 round: checks the pipeline")
    args = parser.parse_args()
    defaults = (32, 1, 512, 2, 1) if args.quick else (128, 2, 2048, 4, 3)
    names = ("max_tokens", "requests", "prefix", "prefix_requests", "rounds")
    settings = {name: getattr(args, name) or default for name, default in zip(names, defaults)}
    if settings["max_tokens"] < 2 or max(args.clients) > SLOTS:
        parser.error(f"--max-tokens must be at least 2 (for a gap between tokens), --clients at most {SLOTS}")
    context = 1 << (max(PROMPT_TOKENS + settings["max_tokens"],
                        settings["prefix"] + SUFFIX_TOKENS + PREFIX_MAX_TOKENS) - 1).bit_length()

    build = Path(args.llama_cpp)
    server_bin, cmake_cache = build / "bin" / "llama-server", build / "CMakeCache.txt"
    if not args.k3_only and not (server_bin.is_file() and cmake_cache.is_file()):
        sys.exit(f"no llama.cpp build with llama-server at {build}: build it as in this script's docstring "
                 "(or give --k3-only)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # so that `finally` stops the servers

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_directory(args.model, tmp, build=default_model)
        tokenizer = K3Tokenizer.load(model_dir)
        n_ids = tokenizer.vocab_size - len(tokenizer.special_tokens)  # prompts hold no special ids

        k3_env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
                      PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))
        k3_cmd = [sys.executable, "-m", "k3", "serve", model_dir, "--host", "127.0.0.1", "--port", None,
                  "--max-batch", SLOTS, "--max-context", context]
        servers = {K3: (k3_cmd, k3_env, {}), K3_NO_CACHE: (k3_cmd + ["--prefix-cache-mib", 0], k3_env, {})}
        if not args.k3_only:
            src = next(line.split("=", 1)[1].strip() for line in cmake_cache.read_text().splitlines()
                       if line.startswith("CMAKE_HOME_DIRECTORY:"))
            gguf = gguf_for(model_dir, "f32", src, args.pydeps)
            llama_cmd = [server_bin, "-m", gguf, "--host", "127.0.0.1", "--port", None, "-np", SLOTS,
                         "-c", SLOTS * context, "-t", args.threads, "-tb", args.threads, "--cont-batching",
                         "--no-webui"]
            servers[LLAMA] = (llama_cmd, None, {"ignore_eos": True, "cache_prompt": True})

        # the same prompts on every server and in every round
        warmup = {"warm-up": (token_ids(0, 1, 1, PROMPT_TOKENS, n_ids), WARMUP_MAX_TOKENS)}
        throughput = {f"{n} clients": (token_ids(n, n, settings["requests"], PROMPT_TOKENS, n_ids),
                                       settings["max_tokens"]) for n in args.clients}
        shared = token_ids(1000, 1, 1, settings["prefix"], n_ids)[0][0]
        prefix = {"prefix warm-up": (token_ids(1001, 1, 1, SUFFIX_TOKENS, n_ids, shared), PREFIX_MAX_TOKENS),
                  "prefix": (token_ids(1002, PREFIX_CLIENTS, settings["prefix_requests"], SUFFIX_TOKENS, n_ids,
                                       shared), PREFIX_MAX_TOKENS)}
        plans = {K3: warmup | throughput | prefix, K3_NO_CACHE: warmup | prefix, LLAMA: warmup | throughput | prefix}

        start, cpu_wait, results = time.perf_counter(), CpuWait(), []
        for r in range(settings["rounds"]):
            order = list(servers) if r % 2 else sorted(servers, key=lambda side: side != LLAMA)
            run = {}
            for label in order:
                cmd, env, extra = servers[label]
                cmd = [free_port() if arg is None else arg for arg in cmd]
                print(f"round {r + 1}/{settings['rounds']}: {label} ...", flush=True)
                run[label] = serve_once(label, cmd, env, extra, plans[label], Path(tmp))
                run[label]["command"] = " ".join(map(str, cmd))
            results.append(run)
        runtime_s = time.perf_counter() - start

    sides = [side for side in (K3, LLAMA) if side in servers]
    print(f"\nMachine: {machine()}")
    print(f"Model: {args.model or 'random-init k3-small, tokenizer replaced (see the docstring of serve.py)'}; "
          f"{args.threads} threads each; max context {context:,} per sequence, {SLOTS} sequences at a time")
    for label in servers:
        last = results[-1][label]
        print(f"{label}: `{last['command']}` (ready after {last['load_s']:.0f} s, peak RSS {last['peak_rss_gib']:.2f} "
              f"GiB)")
    print()
    report(results, sides, args.clients, settings)
    print(f"Total runtime: {runtime_s:.0f} s; load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"CPU wait over the run: {cpu_wait} (PSI; well above 0 % means other processes competed for the cores)")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "settings": {**settings, "clients": args.clients,
                                         "threads": args.threads, "context": context}, "cpu_wait": str(cpu_wait),
                                         "runtime_s": runtime_s, "rounds": results}, indent=1) + "\n")
        print(f"Raw numbers: {args.json}")


if __name__ == "__main__":
    main()
