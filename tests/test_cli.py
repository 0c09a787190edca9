"""`k3 info`: JSON and text architecture reports, presets and checkpoint directories, error exits (spec §2)."""

from __future__ import annotations

import json

import pytest
import torch

from k3.cli import main
from k3.inference import generate
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.accounting import count_parameters


def run_json(capsys, target: str) -> dict:
    assert main(["info", target, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


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
    assert "K2" in out and "1.04 T" in out and "32.6 B" in out and "18432" in out and "33792" in out
    assert "69 KDA" in out and "24 gated NoPE MLA" in out
    assert "13,824" in out
    assert "MoonViT-V2 vision tower" in out and "401,214,464" in out and "46,144,512" in out


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
    """A tiny K3 checkpoint directory with its own trained BPE tokenizer (spec §10 format)."""
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
    expected = generate(model, ids, 12, temperature=0, eos_token_id=[tokenizer.eos_token_id, tokenizer.eod_token_id])
    assert out == "the quick" + tokenizer.decode(expected[0, ids.shape[1]:].tolist()) + "\n"


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
