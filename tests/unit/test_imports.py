"""harmonia's packages import each other only downward, and no module imports itself back.

Every import statement of every module counts: at the top, inside functions and under
``TYPE_CHECKING`` alike (an import deferred into a function is still a dependency). The packages
follow DESIGN.md's line ``workload <- schedule <- sim <- plan <- runtime <- train``; beside it,
``model`` (specs and reference modules) sits below ``workload``, ``data`` (datasets, decoding) uses
only ``model`` and ``workload``, and the top-level modules (``cli``, ``config``, ...) stay where
their users are.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "harmonia"

CHAIN = ("model", "workload", "schedule", "sim", "plan", "runtime", "train")
"""Each package may import those before it (and ``errors``)."""
ALLOWED: dict[str, set[str]] = {p: set(CHAIN[:i]) for i, p in enumerate(CHAIN)}
ALLOWED.update({
    "errors": set(),
    "data": {"model", "workload"},
    "train": set(CHAIN[:-1]) | {"data", "config", "launch", "metrics"},
    "config": {"model", "schedule", "data"},
    "launch": set(CHAIN[:-1]),
    "metrics": set(),
    "cli": set(CHAIN) | {"data", "config", "launch", "metrics"},
    "__main__": {"cli"},
    "__init__": set(),
})


KNOWN_UPWARD: set[tuple[str, str]] = set()
"""Upward imports outside the DESIGN line's packages, still to be removed by their owners."""
KNOWN_CYCLES = {
    frozenset({"harmonia.model.hf.export", "harmonia.model.hf.names", "harmonia.model.hf.whisper"}),
}
"""Import cycles (strongly connected modules) still to be broken by their owners; each must still exist,
so a fixed one is taken off this list."""


def module_name(path: Path) -> str:
    parts = ("harmonia", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported(name: str, path: Path) -> set[str]:
    """harmonia modules that ``name`` imports anywhere in its source (a package's ``__init__`` when a
    name comes from the package itself)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("harmonia")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing package
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("harmonia"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in MODULES else base)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: imported(name, path) for name, path in MODULES.items()}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_is_known() -> None:
    assert {package_of(m) for m in MODULES} <= set(ALLOWED), "a new package needs its place in ALLOWED"


def test_packages_import_only_downward() -> None:
    wrong = []
    for module, deps in GRAPH.items():
        mine = package_of(module)
        for dep in deps:
            theirs = package_of(dep)
            if theirs not in (mine, "errors", "__init__") and theirs not in ALLOWED[mine]:
                wrong.append((module, dep))
    new = [f"{m} imports {d} ({package_of(m)} may import {sorted(ALLOWED[package_of(m)])})"
           for m, d in wrong if (m, d) not in KNOWN_UPWARD]
    assert not new, "\n".join(new)
    assert KNOWN_UPWARD <= set(wrong), f"fixed: take {KNOWN_UPWARD - set(wrong)} off KNOWN_UPWARD"


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The import cycles of ``graph``: its strongly connected sets of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_no_import_cycle() -> None:
    found = set(cycles(GRAPH))
    new = [sorted(c) for c in found - KNOWN_CYCLES]
    assert not new, f"import cycles: {new}"
    assert KNOWN_CYCLES <= found, f"fixed: take {[sorted(c) for c in KNOWN_CYCLES - found]} off KNOWN_CYCLES"


def test_the_checks_see_hidden_imports(tmp_path: Path) -> None:
    """A cycle through a function-level import is found, and so is an upward import inside a function."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": set()}) == []
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from harmonia.train.loop import Trainer\n")
    assert "harmonia.train.loop" in imported("harmonia.sim.fake", source)


@pytest.mark.slow
def test_reading_a_checkpoints_spec_loads_no_model_code(tmp_path: Path) -> None:
    """Planning reads specs from HF checkpoints; the launcher process of a multi-process job does
    too, while its ranks' fork server imports the model code beside it: the spec path must not
    import harmonia's models (or torch._dynamo, which they pull in)."""
    import subprocess
    import sys

    from harmonia.train.tiny_llava import write_tiny_llava
    from harmonia.train.tiny_qwen_vl import write_tiny_qwen_vl

    dirs = [write_tiny_llava(tmp_path / "llava"), write_tiny_qwen_vl(tmp_path / "qwen")]
    code = ("import sys\nfrom harmonia.model.resolve import resolve_mllm\n"
            f"for d in {[str(d) for d in dirs]!r}:\n    resolve_mllm(d)\n"
            "print(sorted(m for m in sys.modules if m in ('harmonia.model.llm', 'harmonia.model.attention', "
            "'harmonia.model.qwen_vit', 'harmonia.model.mllm', 'torch._dynamo')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_rank_imports_no_compiler_or_dtensor_until_it_needs_them() -> None:
    """Every rank imports the trainer before its first step; ``torch._dynamo`` and
    ``torch.distributed.tensor`` (together about half of that import) wait for a job that compiles,
    shards or checkpoints. The attention kernel is kept out of compiled graphs once a job compiles."""
    import subprocess
    import sys

    code = ("import sys\nimport harmonia.train.worker\n"
            "print(sorted(m for m in sys.modules if m in ('torch._dynamo', 'torch.distributed.tensor', "
            "'torch.distributed.checkpoint')))\n"
            "from harmonia.model.attention import LayerAttention\n"
            "from harmonia.runtime.parallelize import apply_compile\n"
            "from harmonia.model.layers import Block\n"
            "import torch\n"
            "print(apply_compile(torch.nn.Sequential()), getattr(LayerAttention.attend, '_torchdynamo_disable', None))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.split("\n")[:2] == ["[]", "0 True"], out.stdout + out.stderr


def test_a_training_command_imports_with_the_collector_off_and_leaves_it_on() -> None:
    """`harmonia train`'s imports and config run without the garbage collector; after them what they
    made is frozen and the collector is on, also where loading the config fails."""
    import gc
    import subprocess
    import sys

    code = ("import gc\nfrom harmonia.cli import _imports_first\n"
            "with _imports_first():\n    seen = gc.isenabled()\n    import torch\n"
            "print(seen, gc.isenabled(), gc.get_freeze_count() > 100_000)\n"
            "try:\n    with _imports_first():\n        raise ValueError\nexcept ValueError:\n    print(gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.split() == ["False", "True", "True", "True"], out.stdout + out.stderr
    assert gc.isenabled()
