"""`k3 train` under torchrun (CPU, gloo) equals one process: losses, resume across world sizes and expert-parallel
degrees (DCP resharding, and a one-process checkpoint sharded on load), the exported model, a killed rank.

Each job is a real `torchrun --standalone` subprocess with a hard timeout (its whole process group is killed), so a
hang fails the test instead of blocking CI. The runs are chained in one module fixture and the tests read them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from k3.train.checkpoint import is_sharded, latest_checkpoint

CORPUS = "\n\n".join(f"Scene {i}. " + "To be, or not to be, that is the question. " * (3 + i % 4) +
                     "Whether 'tis nobler in the mind to suffer the slings and arrows. " * (i % 3 + 1)
                     for i in range(40))
TINY = ["--override", "vocab_size=320", "--override", "num_hidden_layers=5", "--override", "full_attn_layers=[4,5]",
        "--override", "kda_layers=[1,2,3]"]
STEPS = 4
TIMEOUT_S = 240  # per job: a hang fails the test
REL = 1e-4  # fp32 reduction order only


def k3_train(tmp, out, *extra, nproc=1, check=True, timeout=TIMEOUT_S, steps=STEPS):
    """`k3 train` on `nproc` processes (torchrun when > 1); returns the CompletedProcess."""
    args = ["--data", str(tmp / "corpus"), "--out", str(out), "--seq-len", "32", "--batch-size", "4",
            "--eval-every", "2", "--checkpoint-every", "2", *TINY, *extra] + (["--steps", str(steps)] if steps else [])
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K3_CACHE_DIR": str(tmp / "cache")}
    proc = subprocess.Popen([*launcher, "-m", "k3", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"k3 train on {nproc} processes did not finish within {timeout} s")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, output)
    if check and proc.returncode != 0:
        pytest.fail(f"k3 train on {nproc} processes exited {proc.returncode}:\n{output[-3000:]}")
    return result


def metrics(run):
    return {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def resume_copy(src, dst, step):
    """A copy of run `src` whose latest checkpoint is `step` (as if it had stopped there)."""
    shutil.copytree(src, dst)
    (dst / "checkpoints" / "latest").write_text(f"step_{step:07d}\n")
    for later in (dst / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchrun")
    (tmp / "corpus").mkdir()
    for i, doc in enumerate(CORPUS.split("\n\n")):
        (tmp / "corpus" / f"doc{i:02d}.txt").write_text(doc)
    out = {"tmp": tmp}
    out["single"] = k3_train(tmp, tmp / "single")  # one process, 4 steps, checkpoints at 2 and 4
    out["ep2"] = k3_train(tmp, tmp / "ep2", "--ep", "2", nproc=2)  # 2 ranks, expert parallel 2
    out["cp2"] = k3_train(tmp, tmp / "cp2", "--cp", "2", nproc=2, steps=2)  # 2 ranks, every sequence split in two
    # the ep2 run resumed by one process (2 ranks, ep 2 -> 1 process), its newest checkpoint damaged (a shard
    # file lost): the resume names it and falls back to step 2
    shutil.copytree(tmp / "ep2", tmp / "ep2_single")
    (tmp / "ep2_single" / "checkpoints" / "step_0000004" / "dcp" / "__1_0.distcp").unlink()
    out["ep2_single"] = k3_train(tmp, tmp / "ep2_single", "--resume", steps=None)
    # the one-process run's step-2 checkpoint (safetensors) resumed by 4 ranks as dp 2 × ep 2 (1 -> 4)
    resume_copy(tmp / "single", tmp / "single_4", 2)
    out["single_4"] = k3_train(tmp, tmp / "single_4", "--resume", "--ep", "2", nproc=4)
    return out


def assert_losses_match(run, reference, steps):
    for step in steps:
        a, b = run[step], reference[step]
        for key in ("loss", "val_loss"):
            if key in b:
                assert abs(a[key] - b[key]) <= REL * abs(b[key]), (step, key, a[key], b[key])


def test_two_ranks_with_expert_parallelism_equal_one_process(runs):
    tmp = runs["tmp"]
    single, ep2 = metrics(tmp / "single"), metrics(tmp / "ep2")
    assert sorted(ep2) == list(range(STEPS + 1)) == sorted(single)
    assert_losses_match(ep2, single, range(STEPS + 1))
    assert "distributed: 2 ranks (gloo on cpu); FSDP2 over dp 2, ep 2 × replicas 1" in runs["ep2"].stdout
    assert runs["ep2"].stdout.count("validation loss") == 1  # rank 0 reports
    step2 = tmp / "ep2" / "checkpoints" / "step_0000002"
    assert is_sharded(step2) and len(list((step2 / "dcp").glob("*.distcp"))) == 2
    assert latest_checkpoint(tmp / "ep2").name == "step_0000004"


def test_two_ranks_with_context_parallelism_equal_one_process(runs):
    """--cp 2: both ranks take the same rows, each half of every packed 32-token row (documents crossing the
    split): the training losses of the first two steps equal one process's (measured 4e-8 and 9e-6 relative), the
    validation loss after them within 1e-3 (measured 4.5e-4). The split computes the same sums in another order
    (the KDA state carried as an affine prefix) and the fp32 differences grow with each optimiser step, where the
    expert-parallel run, every token's values computed in one process's order, stays within 1e-7."""
    tmp = runs["tmp"]
    single, cp2 = metrics(tmp / "single"), metrics(tmp / "cp2")
    assert sorted(cp2) == [0, 1, 2]
    for step in (1, 2):
        assert abs(cp2[step]["loss"] - single[step]["loss"]) <= REL * single[step]["loss"], step
    assert cp2[0]["val_loss"] == single[0]["val_loss"]
    assert abs(cp2[2]["val_loss"] - single[2]["val_loss"]) <= 1e-3 * single[2]["val_loss"]
    assert "FSDP2 over dp 2, cp 2 (sequences split) × data 1" in runs["cp2"].stdout


def test_context_parallel_options_are_checked(runs):
    tmp = runs["tmp"]
    odd = k3_train(tmp, tmp / "cp_odd", "--cp", "2", "--seq-len", "33", nproc=2, check=False)
    assert odd.returncode != 0 and "--seq-len 33 must divide evenly over --cp 2" in odd.stdout
    alone = k3_train(tmp, tmp / "cp_alone", "--cp", "2", check=False)
    assert alone.returncode != 0 and "--cp 2 needs a multi-process torchrun job (this is a single process)" in alone.stdout


def test_resume_on_another_layout_continues_the_run(runs):
    """2 ranks with ep 2 -> 1 process (falling back from a damaged sharded checkpoint), 1 process -> 4 ranks
    (dp 2 × ep 2, experts sharded over their replicas): every continuation matches the straight one-process run."""
    tmp = runs["tmp"]
    single = metrics(tmp / "single")
    for name in ("ep2_single", "single_4"):
        assert_losses_match(metrics(tmp / name), single, range(3, STEPS + 1))
    assert not is_sharded(tmp / "ep2_single" / "checkpoints" / "step_0000004")  # one process writes safetensors
    assert "checkpoint step_0000004 is damaged" in runs["ep2_single"].stdout
    assert "resumed from" in runs["ep2_single"].stdout and "step_0000002 at step 2" in runs["ep2_single"].stdout
    assert is_sharded(tmp / "single_4" / "checkpoints" / "step_0000004")
    assert "FSDP2 over dp 4, ep 2 × replicas 2" in runs["single_4"].stdout


def test_exported_models_load_and_agree(runs):
    from k3.model import K3ForCausalLM

    tmp = runs["tmp"]
    reference = K3ForCausalLM.from_pretrained(tmp / "single" / "model").state_dict()
    for name in ("ep2", "ep2_single", "single_4"):
        state = K3ForCausalLM.from_pretrained(tmp / name / "model").state_dict()
        assert state.keys() == reference.keys()
        for key, ref in reference.items():
            assert torch.allclose(state[key], ref, rtol=1e-3, atol=1e-5), (name, key)
        assert (tmp / name / "model" / "tiktoken.model").is_file()


def test_k3_export_shards_by_size(runs, tmp_path):
    """`k3 export RUN OUT` of a sharded checkpoint: safetensors split by --max-shard-gib with an index, equal to the
    run's own export."""
    from k3.cli import main
    from k3.model import K3ForCausalLM

    run = runs["tmp"] / "ep2"
    assert main(["export", str(run), str(tmp_path / "out"), "--max-shard-gib", "0.0005"]) == 0
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    assert "tiktoken.model" in files and "trainer_state.json" not in files and "dcp" not in files
    a = K3ForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    b = K3ForCausalLM.from_pretrained(run / "model").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_parallel_options_are_one_line_errors(runs, capsys):
    from k3.cli import main

    tmp = runs["tmp"]
    assert main(["train", "--data", str(tmp / "corpus"), "--out", str(tmp / "x"), "--steps", "2", "--ep", "2"]) == 2
    assert "--ep 2 needs a multi-process torchrun job" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp / "corpus"), "--out", str(tmp / "x"), "--steps", "2", "--cpu-offload"]) == 2
    assert "this is a single process" in capsys.readouterr().err
    bad = k3_train(tmp, tmp / "odd", "--batch-size", "3", "--cpu-offload", nproc=2, check=False)
    assert bad.returncode != 0 and "--batch-size 3 must divide evenly over the 2 processes" in bad.stdout
    assert "k3 train: error: --cpu-offload keeps GPU shards in host memory" in bad.stdout  # both, one line
    assert main(["export", str(tmp / "corpus"), str(tmp / "y")]) == 2
    assert "holds no training checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_killed_rank_stops_the_job_and_resume_continues(runs):
    """SIGKILL of one rank mid-run: torchrun stops the job (non-zero exit, no hang); --resume continues from the
    last complete checkpoint to the end."""
    tmp = runs["tmp"]
    out = tmp / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K3_CACHE_DIR": str(tmp / "cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "k3", "train",
           "--data", str(tmp / "corpus"), "--out", str(out), "--steps", "40", "--seq-len", "32", "--batch-size", "4",
           "--eval-every", "100", "--checkpoint-every", "2", *TINY]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while latest_checkpoint(out) is None or latest_checkpoint(out).name < "step_0000004":
            assert proc.poll() is None and time.monotonic() < deadline, "the job ended before its 2nd checkpoint"
            time.sleep(0.2)
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
        workers = [int(p) for p in children.stdout.split()]  # torchrun's children: the two ranks
        assert len(workers) == 2, children.stdout
        os.kill(workers[1], signal.SIGKILL)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, output[-2000:]
    stopped_at = int(latest_checkpoint(out).name.removeprefix("step_"))
    assert 4 <= stopped_at < 40
    resumed = k3_train(tmp, out, "--resume", nproc=2, steps=40)
    assert f"resumed from {latest_checkpoint(out).parent / f'step_{stopped_at:07d}'}" in resumed.stdout or \
        "resumed from" in resumed.stdout
    assert sorted(metrics(out))[-1] == 40


@pytest.mark.slow
def test_shapes_task_on_two_ranks_equals_one_process(tmp_path):
    """The multimodal task under torchrun (FSDP2): same losses and caption accuracy as one process, the example
    report written once; with --ep it is refused in one line."""
    common = ["--task", "shapes", "--steps", "2", "--batch-size", "4", "--eval-every", "2", "--eval-images", "8",
              "--checkpoint-every", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(out, *extra, nproc):
        launcher = [sys.executable] if nproc == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        return subprocess.run([*launcher, "-m", "k3", "train", *common, "--out", str(out), *extra], env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)

    single, two = run(tmp_path / "one", nproc=1), run(tmp_path / "two", nproc=2)
    assert single.returncode == 0 and two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert_losses_match(b, a, range(3))
    assert a[2]["caption_accuracy"] == b[2]["caption_accuracy"]
    assert (tmp_path / "two" / "examples" / "captions.txt").is_file()
    assert (tmp_path / "two" / "model" / "preprocessor_config.json").is_file()
    refused = run(tmp_path / "ep", "--ep", "2", nproc=2)
    assert refused.returncode != 0 and "--task shapes under torchrun needs --ep 1" in refused.stdout + refused.stderr
