"""`k3 diagram`: every number in the picture is the accounting's, no text overlaps, the file is written atomically
(docs/architecture.md §2, §14)."""

from __future__ import annotations

import re

import matplotlib.text
import pytest

from k3.cli import main
from k3.config import K3Config
from k3.diagram import draw, save_diagram
from k3.model.accounting import architecture_report, attn_res_sources

NAMES = ["k3-full", "k3-small", "k3-tiny-vl", "kimi-k2"]
_NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?")  # not the digits of a name (bf16, fp32, o_proj2)


@pytest.fixture(scope="module")
def figures():
    figs = {name: draw(K3Config.from_preset(name), name) for name in NAMES}
    yield figs
    import matplotlib.pyplot as plt

    for fig in figs.values():
        plt.close(fig)


def texts(fig) -> list[matplotlib.text.Text]:
    return [t for t in fig.findobj(matplotlib.text.Text) if t.get_text().strip()]


def human(n: float) -> list[str]:
    return [f"{n / s:.2f}" for s in (1e12, 1e9, 1e6, 1e3)]


def allowed_numbers(c: K3Config) -> set[str]:
    """Every number the picture may print, computed here from the config and the accounting, in each spelling."""
    r = architecture_report(c)
    D, L = c.hidden_size, c.num_hidden_layers
    moe_layers = sum(c.is_moe_layer(i) for i in range(L))
    router = moe_layers * (c.num_experts * D + c.num_experts)
    shared = moe_layers * 3 * D * c.num_shared_experts * c.moe_intermediate_size
    latent = moe_layers * (2 * D * c.routed_expert_hidden_size + c.routed_expert_hidden_size * c.latent_moe_use_norm) \
        if c.use_latent_moe else 0
    assert router + shared + latent == r["components"]["moe_fixed"]["total"]  # the budget's split of the MoE part
    vision = sum(r["vision_params"].values())
    values = {v for v in vars(c).values() if isinstance(v, int)} | {abs(int(c.gate_lower_bound or 0))}
    values |= set(range(1, L + 1)) | set(attn_res_sources(c)[0]) | {attn_res_sources(c)[1]}
    values |= {r["kda_layers"], r["mla_layers"], moe_layers, L - moe_layers, 2, 14, r["mla_cache_numbers_per_token"]}
    values |= {c.kda_num_heads * c.kda_head_dim, c.num_attention_heads * c.v_head_dim,
               c.num_shared_experts * c.moe_intermediate_size, c.kv_lora_rank + c.qk_rope_head_dim}
    counts = [r["total_params"], r["activated_params"], r["total_params"] + vision, router, shared, latent, vision,
              *(v["total"] for v in r["components"].values())]
    vc = c.vision_config
    if vc is not None:
        values |= {v for v in vars(vc).values() if isinstance(v, int)} | {vc.head_dim, vc.merged_hidden_size}
    spelled = {f"{v:,}" for v in values | set(counts)} | {str(v) for v in values}
    spelled |= {h for n in counts for h in human(n)}
    sizes = [*r["cache_bytes_per_sequence"].values(), r["kda_state_bytes_per_sequence_fp32"],
             c.kda_num_heads * c.kda_head_dim ** 2 * 4]  # bytes, shown in GiB, MiB or KiB
    spelled |= {f"{n / 2**30:.2f}" for n in sizes} | {f"{n / 2**e:.1f}" for n in sizes for e in (10, 20)}
    spelled |= {"4", "128", "1"}  # the context names 4K, 128K, 1M
    return spelled


@pytest.mark.parametrize("name", NAMES)
def test_every_number_in_the_picture_is_the_accounting(figures, name):
    config = K3Config.from_preset(name)
    allowed = allowed_numbers(config)
    shown = [(n, t.get_text()) for t in texts(figures[name]) for n in _NUMBER.findall(t.get_text())]
    assert shown, "the picture prints no number"
    wrong = [(n, text) for n, text in shown if n not in allowed]
    assert not wrong, wrong
    report = architecture_report(config)
    everything = " ".join(t.get_text() for t in texts(figures[name]))
    assert f"{report['total_params']:,} total" in everything and f"{report['activated_params']:,} activated" in everything


@pytest.mark.parametrize("name", NAMES)
def test_no_text_overlaps_or_leaves_the_page(figures, name):
    fig = figures[name]
    renderer = fig.canvas.get_renderer()
    page = fig.bbox
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts(fig)]
    outside = [text for text, b in boxes if b.x0 < page.x0 or b.x1 > page.x1 or b.y0 < page.y0 or b.y1 > page.y1]
    assert not outside, outside
    clashes = [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1:] if ba.overlaps(bb)]
    assert not clashes, clashes


def test_panels_follow_the_config(figures):
    """The picture is drawn from the config: K2's forms show as such, vision only when the config has it."""
    k2 = " ".join(t.get_text() for t in texts(figures["kimi-k2"]))
    assert "MLA with RoPE" in k2 and "plain pre-norm residual stream" in k2 and "MoE (full width)" in k2
    assert "Kimi Delta Attention" not in k2 and "MoonViT" not in k2 and "SwiGLU" in k2
    full = " ".join(t.get_text() for t in texts(figures["k3-full"]))
    assert "Gated NoPE MLA" in full and "Stable LatentMoE" in full and "MoonViT-V2" in full
    assert "cache 576 numbers per token" in full and "top-16 of 896" in full and "latent 3584" in full


def test_written_atomically_in_each_format(tmp_path, monkeypatch):
    config = K3Config.from_preset("k3-tiny")
    for suffix, magic in ((".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF")):
        save_diagram(config, "k3-tiny", tmp_path / f"k3{suffix}")
        assert (tmp_path / f"k3{suffix}").read_bytes().startswith(magic)
    before = (tmp_path / "k3.png").read_bytes()

    def broken(self, path, **kwargs):
        open(path, "wb").write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("matplotlib.figure.Figure.savefig", broken)
    with pytest.raises(OSError):
        save_diagram(config, "k3-tiny", tmp_path / "k3.png")
    assert (tmp_path / "k3.png").read_bytes() == before  # the old picture stays whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k3.pdf", "k3.png", "k3.svg"]  # no temporary left


def test_cli_writes_the_picture_and_names_a_bad_file(tmp_path, capsys):
    assert main(["diagram", "k3-tiny", "-o", str(tmp_path / "tiny.svg")]) == 0
    assert (tmp_path / "tiny.svg").stat().st_size > 0
    assert main(["diagram", "k3-tiny", "-o", str(tmp_path / "tiny.jpg")]) == 2
    err = capsys.readouterr().err
    assert "k3 diagram: error:" in err and "tiny.jpg" in err and ".svg, .png, .pdf" in err
    assert not (tmp_path / "tiny.jpg").exists()
