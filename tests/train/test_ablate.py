"""`k3 ablate`: variants, equal training FLOPs, compute multiplier, resume, outputs (docs/architecture.md §14.5)."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest

import k3.train.ablate as ablate_module
from k3.cli import main
from k3.config import K2_ARCHITECTURE, K3Config, k2_form
from k3.train.ablate import VARIANTS, AblationArgs, flops_per_step, flops_to_reach, variant_config

BUDGET = 3.4e9  # training FLOPs: about 6 steps of 2 × 32 tokens of the TINY model
TINY = {"vocab_size": 320, "num_hidden_layers": 5, "full_attn_layers": [4, 5], "kda_layers": [1, 2, 3]}


def _args(corpus, out, **kw):
    base = dict(out=str(out), flops=BUDGET, variants=("k3", "k2"), data=str(corpus), seq_len=32, batch_size=2,
                eval_batches=2, overrides=TINY)
    return AblationArgs(**{**base, **kw})


def test_variants_turn_exactly_their_innovation_into_the_k2_form(corpus, tmp_path):
    args = _args(corpus, tmp_path, variants=tuple(VARIANTS))
    base = K3Config.from_preset("k3-tiny", **TINY)
    assert variant_config(args, VARIANTS["k3"]) == TINY
    everything = dict(TINY)
    for form in K2_ARCHITECTURE:
        everything |= k2_form(base, form)
    assert variant_config(args, VARIANTS["k2"]) == everything
    assert (VARIANTS["k2"].balancer, VARIANTS["k2"].muon_per_head) == ("sign", "none")
    for form, name in zip(K2_ARCHITECTURE, ("no-hybrid-attention", "no-attn-res", "no-latent-moe", "no-situ")):
        assert variant_config(args, VARIANTS[name]) == TINY | k2_form(base, form)
        assert (VARIANTS[name].balancer, VARIANTS[name].muon_per_head) == ("qb", "qkv")
    assert VARIANTS["no-qb"].balancer == "sign" and VARIANTS["no-per-head-muon"].muon_per_head == "none"
    # FLOPs per step follow the accounting: the K2 form of the MoE at full width costs more per token here
    assert flops_per_step(args, VARIANTS["no-latent-moe"]) > flops_per_step(args, VARIANTS["k3"])


@pytest.mark.parametrize("bad, message", [
    (dict(flops=None), "exactly one of --budget-minutes and --flops"),
    (dict(budget_minutes=5.0), "exactly one of"),
    (dict(flops=-1.0), "--flops must be a finite number > 0"),
    (dict(flops=math.inf), "--flops must be a finite number > 0"),
    (dict(variants=("k3", "k4")), "--variants must name distinct variants"),
    (dict(variants=("k2",)), "must include k3"),
    (dict(variants=("k3", "k3")), "distinct"),
    (dict(overrides={"hidden": 3}), "not K3Config fields: hidden"),
    (dict(flops=6e8), "buys k3 only 1 step"),
])
def test_bad_options_are_named(corpus, tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        _args(corpus, tmp_path, **bad)


def test_flops_to_reach_interpolates_in_log_flops():
    curve = [[0, 8.0], [100, 6.0], [1000, 4.0], [10000, 3.0]]
    assert flops_to_reach(curve, 5.0) == pytest.approx(math.sqrt(100 * 1000))  # halfway in log FLOPs
    assert flops_to_reach(curve, 6.0) == pytest.approx(100)
    assert flops_to_reach(curve, 7.0) == pytest.approx(50)  # from step 0: linear
    assert flops_to_reach(curve, 9.0) == 0
    assert flops_to_reach(curve, 2.5) is None  # never reached


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory):
    """An ablation of k3 and k2 through the command line, paused once in k2 (as by a signal) and continued by the
    same command: (output directory, the Trainer arguments of each run, the printed report)."""
    out = tmp_path_factory.mktemp("ablation") / "abl"
    common = ["ablate", "--data", str(corpus), "--seq-len", "32", "--batch-size", "2", "--out", str(out),
              "--flops", str(BUDGET), "--variants", "k3,k2",
              *(x for k, v in TINY.items() for x in ("--override", f"{k}={json.dumps(v)}"))]
    real, calls = ablate_module.Trainer, []

    def pausing(args):
        calls.append(args)
        trainer = real(args)
        if len(calls) == 2:  # k2's first attempt stops after its first step, with a checkpoint
            trainer.args.stop_after = 1
        return trainer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3_CACHE_DIR", str(corpus.parent / "cache"))
        mp.setattr(ablate_module, "Trainer", pausing)
        mp.setattr("sys.stdout", io.StringIO())
        first = main(common)
        second = main(common)
        printed = sys.stdout.getvalue()
    return out, calls, (first, second), printed, common


def test_variants_train_on_equal_flops_and_the_table_has_the_multiplier(finished):
    out, _, statuses, printed, _ = finished
    assert statuses[1] == 0
    state = json.loads((out / "ablation.json").read_text())
    runs = state["runs"]
    for name in ("k3", "k2"):  # each trained on the budget, to within one step
        assert runs[name]["done"] and abs(runs[name]["flops"] - BUDGET) <= runs[name]["flops_per_step"] / 2
        assert runs[name]["curve"][0][0] == 0 and runs[name]["curve"][-1][0] == runs[name]["flops"]
        assert runs[name]["tokens"] == runs[name]["steps"] * 2 * 32
    k2 = state["results"]["k2"]
    reach = flops_to_reach(runs["k2"]["curve"], runs["k3"]["final_val_loss"])
    assert k2["compute_multiplier"] == (None if reach is None else reach / runs["k3"]["flops"])
    assert state["results"]["k3"]["compute_multiplier"] == pytest.approx(1.0)
    assert (out / "loss_vs_flops.png").stat().st_size > 0
    table = (out / "ablation.md").read_text()
    assert "| k3 | K3: every innovation |" in table and "| k2 | K2's forms" in table and "1.00×" in table
    assert table in printed and ("compute multiplier" in printed or "never reached" in printed)


def test_a_paused_variant_continues_from_its_checkpoint(finished):
    out, calls, statuses, _, _ = finished
    assert statuses[0] == 0  # paused by --stop-after (a signal would exit 128 + its number)
    assert [c.resume for c in calls] == [False, False, True]  # k3, k2 paused, k2 continued (k3 not again)
    assert calls[2].out == str(out / "k2")


def test_a_finished_ablation_is_not_trained_again_and_options_cannot_change(finished, monkeypatch, capsys):
    out, _, _, _, common = finished
    monkeypatch.setattr(ablate_module, "Trainer", lambda args: pytest.fail("retrained"))
    assert main(common) == 0
    assert main([*common, "--batch-size", "4"]) == 2  # the last --batch-size wins
    assert "other options (batch_size: 2 -> 4)" in capsys.readouterr().err


def test_budget_minutes_become_k3_steps_at_the_timed_pace(corpus, tmp_path, monkeypatch):
    """--budget-minutes: K3's share of the budget at the pace of the timed steps, in K3 steps, times their FLOPs."""
    monkeypatch.setenv("K3_CACHE_DIR", str(corpus.parent / "cache"))
    clock = iter([0.0, 3.0])  # three timed steps in 3 s: 1 s a step
    monkeypatch.setattr(ablate_module, "perf_counter", lambda: next(clock))
    args = _args(corpus, tmp_path, flops=None, budget_minutes=1.0)  # k3 and k2: 30 s each, 85 % for steps
    assert ablate_module.budget_flops(args) == 25 * flops_per_step(args, VARIANTS["k3"])


def test_cli_names_bad_options(capsys):
    assert main(["ablate", "--flops", "1e12", "--variants", "k3,k5", "--out", "x"]) == 2
    assert "k3 ablate: error: --variants must name distinct variants" in capsys.readouterr().err
