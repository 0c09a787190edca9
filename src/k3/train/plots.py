"""PNG plots of a training run: loss curves, per-layer expert load, AttnRes mixing weights (docs/architecture.md §5, §7.5)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import ContextManager

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from k3.fileio import atomic_path  # noqa: E402
from k3.model.attn_res import attn_res_weights  # noqa: E402


def plot_losses(history: list[dict], path: str | os.PathLike, references: dict[str, float] | None = None) -> None:
    """Train loss per step and validation loss at its evaluations; `references` baseline losses by label (e.g. the
    unigram entropy and a bigram model's held-out loss), drawn as horizontal lines."""
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(m["step"], m["loss"]) for m in history if "loss" in m]
    val = [(m["step"], m["val_loss"]) for m in history if "val_loss" in m]
    if train:
        ax.plot(*zip(*train), lw=1, label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    for (label, value), style in zip((references or {}).items(), ("--", ":", "-.")):
        ax.axhline(value, ls=style, c="gray", label=label)
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="K3 training loss")
    ax.legend(loc="upper center")
    accuracy = [(m["step"], 100 * m["caption_accuracy"]) for m in history if "caption_accuracy" in m]
    if accuracy:  # the shapes task: held-out caption exact match on a second axis
        acc_ax = ax.twinx()
        acc_ax.plot(*zip(*accuracy), "s-", c="tab:green", label="caption exact match")
        acc_ax.set(ylabel="held-out caption exact match (%)", ylim=(0, 100))
        acc_ax.legend(loc="upper right")
    _save(fig, path)


def plot_ablation(curves: dict[str, list[list[float]]], k3_loss: float, path: str | os.PathLike) -> None:
    """Validation loss against training FLOPs, one line per ablation variant (K3 and K2 drawn heavier), with K3's
    final loss as a horizontal line."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, curve in curves.items():
        points = [(f, loss) for f, loss in curve if f > 0]  # step 0 has no place on a log axis
        if points:
            ax.plot(*zip(*points), "o-" if name in ("k3", "k2") else ".-", lw=2.2 if name in ("k3", "k2") else 1,
                    ms=4, label=name)
    ax.axhline(k3_loss, ls="--", c="gray", lw=0.8, label="K3's final loss")
    ax.set(xscale="log", xlabel="training FLOPs (accounting)", ylabel="validation loss (nats/token)",
           title="K3 ablation at equal training FLOPs")
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_expert_load(load_XE: torch.Tensor, path: str | os.PathLike) -> None:
    """Heatmap of each MoE layer's expert load as a multiple of the balanced load (1 = balanced)."""
    fig, ax = plt.subplots(figsize=(8, 0.4 * load_XE.shape[0] + 1.5))
    image = ax.imshow(load_XE.numpy(), aspect="auto", cmap="viridis")
    ax.set(xlabel="expert", ylabel="MoE layer (0 = layer 1)", title="expert load / balanced load (last step)")
    fig.colorbar(image, ax=ax)
    _save(fig, path)


@torch.no_grad()
def attn_res_mixing(model, inputs: dict[str, torch.Tensor],
                    parameters: Callable[[], ContextManager] = contextlib.nullcontext) -> tuple[torch.Tensor, list[str]]:
    """Mean pre-attention mixing weight of every decoder layer over its sources (rows: layers 1..L−1, then the
    output mix; columns: b₀ = embedding, b₁, …, partial sum), NaN where a layer has fewer sources.
    `inputs` are keyword arguments of the model's forward (text or multimodal). The weights are computed after
    the forward inside `parameters()`: a context in which the AttnRes parameters are whole tensors (a sharded
    model passes `k3.parallel.fsdp.gathered`)."""
    backbone = getattr(model, "language_model", model).model
    layer_inputs = []
    hooks = [layer.register_forward_pre_hook(lambda _, args: layer_inputs.append(args[:2]))
             for layer in backbone.layers]
    last_out = []
    hooks.append(backbone.layers[-1].register_forward_hook(lambda _m, _a, out: last_out.append(out)))
    try:
        model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    rows, labels = [], []
    mixes = [(layer, cur, bank) for layer, (cur, bank) in zip(backbone.layers, layer_inputs) if bank]
    with parameters():
        for layer, cur, bank in mixes:
            rows.append(attn_res_weights(bank + [cur], layer.self_attention_res_norm,
                                         layer.self_attention_res_proj))
            labels.append(f"layer {layer.layer_idx}")
        cur, bank = last_out[0]
        rows.append(attn_res_weights(bank + [cur], backbone.output_attn_res_norm, backbone.output_attn_res_proj))
        labels.append("output")
    width = max(p.shape[0] for p in rows)
    table = torch.full((len(rows), width), float("nan"))
    for i, p_SBT in enumerate(rows):
        table[i, : p_SBT.shape[0]] = p_SBT.float().mean(dim=(1, 2))
    return table, labels


def plot_attn_res(table: torch.Tensor, labels: list[str], path: str | os.PathLike) -> None:
    fig, ax = plt.subplots(figsize=(6, 0.35 * len(labels) + 1.5))
    image = ax.imshow(table.numpy(), aspect="auto", cmap="magma", vmin=0, vmax=1)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xticks(range(table.shape[1]), ["b0 (emb)"] + [f"b{i}" for i in range(1, table.shape[1])])
    ax.set(title="AttnRes mixing weights (mean over tokens)",
           xlabel="source (each row's last one is its current partial sum)")
    fig.colorbar(image, ax=ax)
    _save(fig, path)


def plot_captions(images, truths: list[str], predictions: list[str], path: str | os.PathLike) -> None:
    """A grid of images, each titled with the model's caption (green if exactly right, red otherwise) and the
    true caption below it."""
    cols = min(4, len(images))
    rows = -(-len(images) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, truth, guess in zip(axes.flat, images, truths, predictions):
        ax.imshow(image)
        shown = "".join(c if c.isprintable() else "?" for c in guess)  # an untrained model emits any bytes
        ax.set_title(f"model: {shown}", fontsize=7, color="tab:green" if guess == truth else "tab:red")
        ax.text(0.5, -0.06, f"true: {truth}", fontsize=7, ha="center", va="top", transform=ax.transAxes)
    _save(fig, path)


def plot_recall(results: dict[str, list], path: str | os.PathLike, train_length: int | None = None) -> None:
    """Pass-key recall (k3.train.recall): per model a heatmap of accuracy by context length (columns) and needle
    depth (rows), and one panel of the accuracy averaged over depths against length, every model on it."""
    fig, axes = plt.subplots(1, len(results) + 1, figsize=(4.2 * (len(results) + 1), 3.6), squeeze=False)
    for ax, (label, cells) in zip(axes[0], results.items()):
        lengths = sorted({c.length for c in cells})
        depths = sorted({c.depth for c in cells})
        grid = torch.full((len(depths), len(lengths)), float("nan"))
        for c in cells:
            grid[depths.index(c.depth), lengths.index(c.length)] = c.accuracy
        ax.imshow(grid.numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for (i, j), value in zip(((i, j) for i in range(len(depths)) for j in range(len(lengths))), grid.flatten()):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [_tokens(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=7)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(label, fontsize=9)
    ax = axes[0][-1]
    for label, cells in results.items():
        lengths = sorted({c.length for c in cells})
        mean = [sum(c.hits for c in cells if c.length == n) / sum(c.samples for c in cells if c.length == n)
                for n in lengths]
        ax.plot(lengths, mean, marker="o", label=label)
    if train_length:
        ax.axvline(train_length, color="grey", linestyle=":", label=f"trained at {_tokens(train_length)}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("recall (all depths)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    _save(fig, path)


def _tokens(n: int) -> str:
    return f"{n // 2**20}M" if n % 2**20 == 0 else f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _save(fig, path) -> None:
    """Write `fig` to `path` atomically (the temporary name keeps the suffix savefig takes the format from)."""
    try:
        fig.tight_layout()
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
