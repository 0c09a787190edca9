"""What MXFP4 export costs a trained model, with and without quantisation-aware training (docs/architecture.md §11.5).

    PYTHONPATH=src .venv/bin/python benchmarks/qat.py [--steps 600] [--out runs/qat]

Trains the demo's model (k3-tiny cut to 3 layers, on the works of Shakespeare, `make demo`'s recipe) twice on the same
batches for `--steps` steps: plainly, and with `k3 train --mxfp4-experts`. Each run is exported with its routed
experts in MXFP4 (`k3 export --experts mxfp4`) and reloaded packed. Reported, on every held-out token of the demo's
evaluation (nats/token): the model as trained (the QAT run with its experts MXFP4-rounded, as in training), the packed
export, and the gap between them.
"""

import argparse
import subprocess
import sys
from pathlib import Path

import torch

from common import CpuWait, machine, print_table
from k3.model import K3ForCausalLM
from k3.ops.loss import IGNORE_INDEX
from k3.train.args import TrainArgs
from k3.train.qat import apply_mxfp4_qat
from k3.train.tasks import TextTask

RECIPE = ["--preset", "k3-tiny", "--override", "num_hidden_layers=3", "--batch-size", "8", "--warmup-frac", "0.1"]


@torch.no_grad()
def held_out_loss(model, task: TextTask) -> float:
    """Mean next-token loss (nats) over every scored token of the task's evaluation rows."""
    total, count = 0.0, 0
    for batch in task.val_batches():
        n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        total += model(**batch).loss.item() * n
        count += n
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", default="runs/qat")
    args = parser.parse_args()
    print(machine())
    wait = CpuWait()
    rows, task = [], None
    for name, flags in (("plain", []), ("--mxfp4-experts", ["--mxfp4-experts"])):
        run = Path(args.out) / name.strip("-")
        if not (run / "model").is_dir():
            subprocess.run([sys.executable, "-m", "k3", "train", *RECIPE, "--steps", str(args.steps), "--out",
                            str(run), "--eval-every", str(args.steps), *flags], check=True)
        packed_dir = run / "model-mxfp4"
        if not packed_dir.is_dir():
            subprocess.run([sys.executable, "-m", "k3", "export", str(run), str(packed_dir), "--experts", "mxfp4"],
                           check=True)
        trained = K3ForCausalLM.from_pretrained(run / "model").eval()
        if flags:
            apply_mxfp4_qat(trained)  # the model as it was trained
        if task is None:
            options = TrainArgs(out=str(run), steps=1).for_new_run()
            task = TextTask(trained.config, data=None, seq_len=options.seq_len, batch_size=8, seed=options.seed,
                            eval_batches=options.eval_batches)
        packed = K3ForCausalLM.from_pretrained(packed_dir).eval()
        as_trained, exported = held_out_loss(trained, task), held_out_loss(packed, task)
        rows.append([name, args.steps, f"{as_trained:.4f}", f"{exported:.4f}", f"{exported - as_trained:+.4f}"])
    print_table(["training", "steps", "as trained", "MXFP4 export", "gap (nats/token)"], rows, "lrrrr")
    print(f"held-out tokens: {task.eval_tokens:,}; CPU wait {wait}")


if __name__ == "__main__":
    main()
