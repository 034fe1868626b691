"""The package imports one way: engine -> runners -> attention backends -> kernels, with the step
plan, the forward context and the models below the runtime. Read from the source (every import,
function-local ones included; ``if TYPE_CHECKING:`` blocks excepted), so a cycle hidden in a
function cannot creep back."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# installed package name -> source folder (pyproject's package-dir)
FOLDERS = {"tscompile": ROOT / "tscompile", "tscompile.custom_ops": ROOT / "custom_ops",
           "tscompile.passes": ROOT / "passes", "tscompile.bench": ROOT / "bench"}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: pathlib.Path, module: str, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
            for child in node.body for n in ast.walk(child)}
    out = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names]
            # `from pkg import submodule` needs the submodule; any other name needs pkg's __init__
            names = subs + ([base] if not all(n in known for n in subs) else [])
        else:
            continue
        for name in names:
            while name and name not in known:  # the longest known prefix: a module, not an attribute
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


MODULES = _modules()
GRAPH = {m: _imports(p, m, set(MODULES)) for m, p in MODULES.items()}


def _reaches(src: str, dst: str) -> list[str] | None:
    stack, seen = [(src, [src])], set()
    while stack:
        node, path = stack.pop()
        for nxt in GRAPH.get(node, ()):
            if nxt == dst:
                return path + [nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_import_cycle_in_the_package():
    # a package __init__ importing its own submodules is not a cycle of interest: skip those edges
    for m in MODULES:
        for dep in GRAPH[m]:
            if m.startswith(dep + "."):
                continue  # a submodule importing its package's __init__
            back = _reaches(dep, m)
            if back is not None and not all(a.startswith(b + ".") or b.startswith(a + ".")
                                            for a, b in zip(back, back[1:])):
                pytest.fail(f"import cycle: {m} -> {' -> '.join(back)}")


@pytest.mark.parametrize("lower, upper", [
    ("tscompile.models", "tscompile.runtime"),
    ("tscompile.models", "tscompile.attention"),
    ("tscompile.runtime.scheduler", "tscompile.runtime.model_runner"),
    ("tscompile.runtime.scheduler", "tscompile.attention"),
    ("tscompile.runtime.step_builder", "tscompile.runtime.model_runner"),
    ("tscompile.runtime.step_builder", "tscompile.attention"),
    ("tscompile.piece_compiler", "tscompile.runtime"),
    ("tscompile.attention", "tscompile.runtime"),
    ("tscompile.forward_context", "tscompile.attention"),
    ("tscompile.step_plan", "tscompile.runtime"),
    ("tscompile.custom_ops", "tscompile.attention"),
])
def test_lower_layers_never_import_upper_ones(lower, upper):
    for m in MODULES:
        if m == lower or m.startswith(lower + "."):
            bad = sorted(d for d in GRAPH[m] if d == upper or d.startswith(upper + "."))
            assert not bad, f"{m} imports {bad}"


def _reach(src: str) -> set[str]:
    """Every module ``src`` imports, directly or through others (function-local imports included)."""
    seen, stack = set(), [src]
    while stack:
        for nxt in GRAPH.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


LEAVES = {"tscompile.utils", "tscompile.kernel_policy", "tscompile.kv_cache", "tscompile.kv_cache.slots",
          "tscompile.kv_cache.pool", "tscompile.kv_cache.spec"}


def test_the_custom_ops_are_the_lowest_layer():
    """The ops import torch, triton, each other and small leaf modules only (function-local imports
    included): nothing they reach imports back up."""
    ops = [m for m in MODULES if m == "tscompile.custom_ops" or m.startswith("tscompile.custom_ops.")]
    for m in ops:
        above = sorted(d for d in _reach(m) if not d.startswith("tscompile.custom_ops") and d not in LEAVES)
        assert not above, f"{m} reaches {above}"


def test_the_package_init_and_the_backend_reach_neither_engine_nor_models_nor_packages():
    """``import tscompile`` imports the ops (and the version); the backend, its compiler and its passes
    never reach the engine, the models, packages, the bench or the attention backends. The runtime
    modules below the backend are the graph runner (its ``capture_graph`` serves the torch.compile
    users' graphs) and the pointer guard it uses; neither imports anything above it."""
    assert _reach("tscompile") <= {"tscompile.version", *LEAVES, *(m for m in MODULES if m.startswith("tscompile.custom_ops"))}
    upper = ("tscompile.runtime", "tscompile.models", "tscompile.package", "tscompile.bench", "tscompile.attention",
             "tscompile.export", "tscompile.sampling")
    for m in ["tscompile.backend", "tscompile.piece_compiler", "tscompile.config",
              *(m for m in MODULES if m.startswith("tscompile.passes"))]:
        below = {"tscompile.runtime.graph_runner", "tscompile.runtime.pointer_guard"}
        bad = sorted(d for d in _reach(m) if d.startswith(upper) and d not in below)
        assert not bad, f"{m} reaches {bad}"


def test_torch_compile_with_the_backend_loads_no_engine_module():
    """In a fresh process: ``torch.compile(nn.Linear(4, 4), backend="tscompile")`` runs (found through
    the entry point, its output equal to eager's) and leaves the engine, models, packages and bench out
    of ``sys.modules``; ``tscompile.LLM`` is then a lazy attribute that loads the engine."""
    import subprocess
    import sys

    code = """
import sys
import torch
model = torch.nn.Linear(4, 4)
x = torch.randn(3, 4)
out = torch.compile(model, backend="tscompile")(x)
torch.testing.assert_close(out, model(x))
heavy = sorted(m for m in sys.modules if m.split(".")[:2] in (["tscompile", "runtime"], ["tscompile", "models"],
                                                             ["tscompile", "package"], ["tscompile", "bench"]))
assert not heavy, heavy
import tscompile
assert "tscompile.runtime.engine" not in sys.modules and "LLM" in dir(tscompile)
assert tscompile.LLM.__module__ == "tscompile.runtime.engine" and "tscompile.runtime.engine" in sys.modules
assert tscompile.package.load_package is tscompile.load_package
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_an_unknown_attribute_of_the_package_is_an_attribute_error():
    import tscompile

    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        tscompile.Engine  # noqa: B018
    assert set(tscompile.__all__) <= set(dir(tscompile))
    assert tscompile.models.build_config is not None  # a subpackage read as an attribute imports it
