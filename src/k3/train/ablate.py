"""`k3 ablate`: K3 against its K2 baseline and against "K3 minus one innovation", at equal training FLOPs
(docs/architecture.md §14.5).

Every variant is an ordinary `k3 train` run in `out/<variant>` on the same data, tokenizer, batches, seed and
recipe (a fixed-length schedule); only the config fields of `k3.config.k2_form` and the two training switches
(balancer, Muon block view) differ. With `flops` every variant trains that many FLOPs; with `budget_minutes` a few
timed K3 steps turn K3's share of the budget into its number of steps, and the FLOPs of those steps become the
budget of every variant. FLOPs are counted by the accounting (3 × forward FLOPs per token × tokens per step,
`forward_flops_per_token`), never by wall time. The state lives in `out/ablation.json`, rewritten after every
variant, so an interrupted ablation continues where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from time import perf_counter

from tqdm.auto import tqdm

from k3.config import K2_ARCHITECTURE, K3Config, k2_overrides
from k3.fileio import atomic_write
from k3.model.accounting import count_parameters, forward_flops_per_token, meta_model
from k3.train import plots
from k3.train.args import TrainArgs
from k3.train.checkpoint import checkpoint_candidates
from k3.train.trainer import Trainer

STATE_FILE = "ablation.json"
EVALS_PER_RUN = 8  # validation points on each loss-vs-FLOPs curve (plus step 0)
TIMED_STEPS = 3  # K3 steps timed (after one warm-up step) to turn --budget-minutes into a number of steps
TRAINING_SHARE = 0.85  # of a run's time, left for training steps (evaluations, checkpoints and export take the rest)


@dataclass(frozen=True)
class Variant:
    """A model/recipe to compare: K3 with `k2_forms` (architecture innovations) and the training switches."""

    name: str
    description: str
    k2_forms: tuple[str, ...] = ()
    balancer: str = "qb"
    muon_per_head: str = "qkv"


_FORM_NAMES = {"attention": "hybrid-attention", "attn_res": "attn-res", "latent_moe": "latent-moe", "situ": "situ"}
_FORM_TEXT = {"attention": "MLA with RoPE in every layer", "attn_res": "plain residuals",
              "latent_moe": "full-width experts, no latent norm", "situ": "SwiGLU"}
VARIANTS = {v.name: v for v in [
    Variant("k3", "K3: every innovation"),
    Variant("k2", "K2's forms: " + ", ".join(_FORM_TEXT.values()) + ", sign balancing, whole-matrix Muon",
            K2_ARCHITECTURE, "sign", "none"),
    *(Variant(f"no-{_FORM_NAMES[form]}", f"K3 with {_FORM_TEXT[form]}", (form,)) for form in K2_ARCHITECTURE),
    Variant("no-qb", "K3 with sign balancing instead of Quantile Balancing", balancer="sign"),
    Variant("no-per-head-muon", "K3 with whole-matrix Muon instead of Per-Head Muon", muon_per_head="none"),
]}
"""K3, K2, and K3 minus each innovation (its K2 form in its place)."""


@dataclass
class AblationArgs:
    out: str
    budget_minutes: float | None = None  # K3's steps fill budget_minutes / len(variants); all train on its FLOPs
    flops: float | None = None  # or: the training FLOPs of every variant
    variants: tuple[str, ...] = tuple(VARIANTS)
    preset: str = "k3-tiny"
    overrides: dict | None = None  # K3Config fields of the preset, for every variant (before their K2 forms)
    data: str | None = None  # None: the works of Shakespeare, as `k3 train`
    seq_len: int = 256
    batch_size: int = 8
    lr: float | None = None  # None: the text task's default
    warmup_frac: float = 0.1
    eval_batches: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.budget_minutes is None) == (self.flops is None):
            raise ValueError("give exactly one of --budget-minutes and --flops")
        for name in ("budget_minutes", "flops"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {v!r}")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants or len(set(self.variants)) != len(self.variants):
            raise ValueError(f"--variants must name distinct variants of {', '.join(VARIANTS)}; got "
                             f"{', '.join(self.variants) or 'none'}")
        if "k3" not in self.variants:
            raise ValueError("--variants must include k3: the others are compared with it")
        self.variants = ("k3", *(v for v in self.variants if v != "k3"))  # K3 first: it sets the FLOP budget
        unknown = sorted(set(self.overrides or {}) - set(K3Config.__dataclass_fields__))
        if unknown:
            raise ValueError(f"--override: not K3Config fields: {', '.join(unknown)}")
        for name in self.variants:  # every variant's config is valid before anything trains
            K3Config.from_preset(self.preset, **variant_config(self, VARIANTS[name]))
            per_step = flops_per_step(self, VARIANTS[name]) if self.flops is not None else None
            if per_step is not None and round(self.flops / per_step) < 2:
                raise ValueError(f"--flops {self.flops:.3g} buys {name} only {round(self.flops / per_step)} step(s) "
                                 f"of {per_step:.3g} FLOPs; give at least two steps' worth")


def variant_config(args: AblationArgs, variant: Variant) -> dict:
    """The K3Config overrides of `variant` on the preset: the ablation's own, then the variant's K2 forms."""
    overrides = dict(args.overrides or {})
    return overrides | k2_overrides(K3Config.from_preset(args.preset, **overrides), variant.k2_forms)


def flops_per_step(args: AblationArgs, variant: Variant) -> int:
    """Training FLOPs of one step: 3 × forward FLOPs per token at the row length × tokens per step (§2.2)."""
    config = K3Config.from_preset(args.preset, **variant_config(args, variant))
    params = count_parameters(meta_model(config), config)
    return 3 * forward_flops_per_token(config, params, args.seq_len) * args.batch_size * args.seq_len


def _train_args(args: AblationArgs, variant: Variant, run: Path, steps: int) -> TrainArgs:
    every = max(1, steps // EVALS_PER_RUN)
    return TrainArgs(task="text", preset=args.preset, data=args.data, steps=steps, out=str(run),
                     seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, warmup_frac=args.warmup_frac,
                     eval_every=every, eval_batches=args.eval_batches, checkpoint_every=4 * every, seed=args.seed,
                     balancer=variant.balancer, muon_per_head=variant.muon_per_head,
                     overrides=variant_config(args, variant))


def budget_flops(args: AblationArgs) -> float:
    """The FLOPs of every variant for a `budget_minutes` ablation: as many K3 steps as fit in K3's share of the
    budget (at the pace of `TIMED_STEPS` timed steps, `TRAINING_SHARE` of it for training), times K3's FLOPs per
    step."""
    k3 = VARIANTS["k3"]
    with tempfile.TemporaryDirectory() as scratch:
        trainer = Trainer(_train_args(args, k3, Path(scratch) / "k3", 10 * (TIMED_STEPS + 1)))
        trainer.train_step()  # warm-up: first-call allocations
        started = perf_counter()
        for _ in range(TIMED_STEPS):
            trainer.train_step()
        pace = (perf_counter() - started) / TIMED_STEPS
    steps = max(2, int(TRAINING_SHARE * 60 * args.budget_minutes / len(args.variants) / pace))
    return float(steps * flops_per_step(args, k3))


def ablate(args: AblationArgs) -> dict:
    """Train every variant not done yet (resuming an interrupted one), then write the table and the plot.
    Returns the state; `state["stopped_by"]` names a signal that paused a run (None when complete)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = _load_state(out, args)
    if state["flops"] is None:  # a --budget-minutes ablation, not started yet
        state["flops"] = budget_flops(args)
        _save_state(out, state)
    bar = tqdm(args.variants, desc="ablate", dynamic_ncols=True)
    for name in bar:
        bar.set_postfix(variant=name)
        run = state["runs"].setdefault(name, {"done": False})
        if run["done"]:
            continue
        variant = VARIANTS[name]
        per_step = flops_per_step(args, variant)
        if checkpoint_candidates(out / name):  # a paused or interrupted run: continue it
            train_args = TrainArgs(out=str(out / name), resume=True)
        else:
            train_args = _train_args(args, variant, out / name, max(2, round(state["flops"] / per_step)))
        summary = Trainer(train_args).run()
        if summary["stopped_by"]:
            state["stopped_by"] = summary["stopped_by"]
            _save_state(out, state)
            return state
        run.update(done=True, steps=summary["step"], flops_per_step=per_step, flops=summary["step"] * per_step,
                   tokens=summary["step"] * args.batch_size * args.seq_len, final_val_loss=summary["final_val_loss"],
                   curve=_curve(out / name, per_step))
        _save_state(out, state)
    state["stopped_by"] = None
    state["results"] = results(state, args.variants)
    _save_state(out, state)
    atomic_write(out / "ablation.md", table(state))
    plots.plot_ablation({name: state["runs"][name]["curve"] for name in args.variants},
                        state["runs"]["k3"]["final_val_loss"], out / "loss_vs_flops.png")
    return state


def _load_state(out: Path, args: AblationArgs) -> dict:
    """The stored state of an ablation in `out` (its options must match), or a new one."""
    path = out / STATE_FILE
    options = {k: v for k, v in asdict(args).items() if k != "out"}
    options["variants"] = list(options["variants"])
    if not path.exists():
        flops = None if args.flops is None else float(args.flops)
        return {"options": options, "flops": flops, "runs": {}, "stopped_by": None}
    try:
        state = json.loads(path.read_text())
        stored = state["options"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not an ablation state file ({e})") from e
    changed = sorted(k for k in options if stored.get(k) != options[k])
    if changed:
        raise ValueError(f"{out} holds an ablation with other options ({', '.join(changed)}: "
                         f"{', '.join(f'{stored.get(k)!r} -> {options[k]!r}' for k in changed)}); continue it with "
                         "the same options or use another --out")
    return state


def _save_state(out: Path, state: dict) -> None:
    atomic_write(out / STATE_FILE, json.dumps(state, indent=1) + "\n")


def _curve(run: Path, per_step: int) -> list[list[float]]:
    """[(training FLOPs, validation loss)] at every evaluation of a finished run, from its metrics.jsonl."""
    points = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "val_loss" in m:
            points.append([m["step"] * per_step, m["val_loss"]])
    return points


def flops_to_reach(curve: list[list[float]], target: float) -> float | None:
    """The training FLOPs at which a loss curve first reaches `target`, interpolated linearly in log FLOPs between
    the evaluations around the crossing (linearly from step 0); None if it never does."""
    if curve and curve[0][1] <= target:
        return curve[0][0]
    for (f0, l0), (f1, l1) in zip(curve, curve[1:]):
        if l1 <= target:  # the first crossing: l0 > target
            t = (l0 - target) / (l0 - l1)
            return f0 + t * (f1 - f0) if f0 <= 0 else math.exp(math.log(f0) + t * (math.log(f1) - math.log(f0)))
    return None


def results(state: dict, names: tuple[str, ...]) -> dict:
    """Per variant: final loss, tokens, FLOPs and the compute multiplier — the FLOPs it needs to reach K3's final
    loss over the FLOPs K3 used (None: not reached within its budget)."""
    k3 = state["runs"]["k3"]
    out = {}
    for name in names:
        run = state["runs"][name]
        reach = flops_to_reach(run["curve"], k3["final_val_loss"])
        out[name] = {"final_val_loss": run["final_val_loss"], "tokens": run["tokens"], "flops": run["flops"],
                     "steps": run["steps"], "flops_to_k3_loss": reach,
                     "compute_multiplier": None if reach is None else reach / k3["flops"]}
    return out


def table(state: dict) -> str:
    """The results as a Markdown table."""
    rows = ["| variant | what changes | steps | tokens | training FLOPs | final val loss | FLOPs to K3's loss "
            "(× K3's) |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, r in state["results"].items():
        multiplier = "not reached" if r["compute_multiplier"] is None else f"{r['compute_multiplier']:.2f}×"
        rows.append(f"| {name} | {VARIANTS[name].description} | {r['steps']:,} | {r['tokens']:,} | "
                    f"{r['flops']:.3e} | {r['final_val_loss']:.3f} | {multiplier} |")
    return "\n".join(rows) + "\n"


def describe(state: dict, out: str | os.PathLike) -> str:
    """What `k3 ablate` prints at the end: the table and the K2 compute multiplier in words."""
    k2 = state["results"].get("k2")
    lines = [table(state)]
    if k2 is not None:
        if k2["compute_multiplier"] is None:
            lines.append(f"K2-style never reached K3's final loss {state['results']['k3']['final_val_loss']:.3f} "
                         f"within its {k2['flops']:.3e} FLOPs (best {k2['final_val_loss']:.3f}).")
        else:
            lines.append(f"compute multiplier: the K2-style model needs {k2['compute_multiplier']:.2f}× K3's "
                         "training FLOPs to reach K3's final validation loss.")
    lines.append(f"table: {Path(out) / 'ablation.md'}; plot: {Path(out) / 'loss_vs_flops.png'}; "
                 f"state: {Path(out) / STATE_FILE}")
    return "\n".join(lines)
