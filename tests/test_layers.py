"""The package's imports point one way (docs/architecture.md, "Package layers"): building blocks → model →
generation / optimisation → scale-out → training and serving → command line, with no cycle between subpackages."""

from __future__ import annotations

import ast
from pathlib import Path

import k3

ROOT = Path(k3.__file__).parent

# lower layers first; a module may import its own subpackage and anything of a strictly lower layer
LAYERS = [
    {"ops", "fileio", "runtime"},
    {"config"},
    {"checkpoint", "tokenizer"},
    {"vision"},
    {"model"},
    {"inference", "optim", "diagram"},
    {"parallel"},
    {"train", "serve"},
    {"cli"},
    {"__main__"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def unit(path: Path) -> str:
    """The subpackage (or top-level module) a file belongs to."""
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def k3_imports(path: Path) -> set[str]:
    """Subpackages/modules of k3 imported anywhere in the file (also inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[1] for n in names if n.startswith("k3.") and n.count(".") >= 1}
    return found


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "__init__.py":  # the public API re-exports every layer
            continue
        graph.setdefault(unit(path), set()).update(k3_imports(path) - {unit(path)})
    return graph


def test_every_unit_has_a_layer():
    assert set(import_graph()) <= set(RANK), set(import_graph()) - set(RANK)


def test_imports_only_point_down():
    wrong = [f"{a} imports {b}" for a, targets in import_graph().items() for b in targets if RANK[b] >= RANK[a]]
    assert not wrong, wrong


def test_no_cycle_between_subpackages():
    graph = import_graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            assert state.get(nxt) != 1, " -> ".join(path + [node, nxt])
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


def test_model_layer_imports_no_generation_training_or_optimisation():
    assert not import_graph()["model"] & {"inference", "train", "optim", "parallel", "cli"}


def test_public_api():
    import k3.model
    import k3.vision.processor

    assert k3.K3ForCausalLM is k3.model.K3ForCausalLM
    assert k3.K3ForConditionalGeneration is k3.model.K3ForConditionalGeneration
    assert k3.K3Processor is k3.vision.processor.K3Processor
    assert {"K3Config", "K3ForCausalLM", "K3ForConditionalGeneration", "K3Tokenizer", "K3Processor",
            "generate"} <= set(k3.__all__)


def test_model_code_makes_no_kernel_choice():
    """The model's modules call one `ops` entry per operation; which implementation runs is chosen in `ops` or by the
    compiled decode step (`k3.inference.compiled_step`), never in `k3.model`: no module of it imports the kernel
    registry, the decode kernel's operations or one KDA implementation directly."""
    choosers = {"k3.ops.compiled", "k3.ops.decode", "k3.ops.kda.gpu", "k3.ops.kda.chunk", "k3.ops.kda.naive",
                "k3.ops.kda.cpu", "k3.ops.kda.varlen"}
    wrong = []
    for path in (ROOT / "model").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module == "k3.ops":
                names = [f"k3.ops.{alias.name}" for alias in node.names]
            wrong += [f"{path.name} imports {name}" for name in names if name in choosers]
    assert not wrong, wrong
