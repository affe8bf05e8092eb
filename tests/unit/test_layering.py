"""The package's structure, checked from its source: every module imports, imports flow
one way between the layers (no circles), the core loads without torch, transport
internals stay behind the executor, no private name crosses a module boundary, and user
errors are the library's own error family."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import reshard

SRC = Path(reshard.__file__).parent

#: Which layer each module belongs to (by its dotted name under ``reshard``); the first
#: matching prefix wins.
LAYERS = (
    ("_transport.", "runtime"), ("refit.", "refit"), ("refit", "refit"),
    ("integrations.", "integrations"), ("integrations", "integrations"),
    ("sim.", "sim"), ("sim", "sim"), ("tools.", "tools"), ("tools", "tools"),
    ("_transport", "runtime"), ("comm", "runtime"), ("gate", "runtime"),
    ("store", "runtime"), ("executor", "runtime"),
    ("dtensor", "runtime"), ("", "core"),
)

#: What each layer may import (besides itself).
ALLOWED = {
    "core": set(),
    "sim": {"core"},
    "runtime": {"core"},
    "refit": {"core", "runtime"},
    "integrations": {"core", "runtime", "refit", "sim"},
    "tools": {"core", "runtime", "refit", "sim", "integrations"},
}

#: Modules that load neither torch nor anything else heavy.
TORCH_FREE = ("core", "sim")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(("reshard", *parts))] = path
    return out


MODULES = _modules()


def layer(module: str) -> str:
    name = module.removeprefix("reshard").removeprefix(".")
    return next(lay for prefix, lay in LAYERS if name.startswith(prefix) and (
        prefix.endswith(".") or prefix == "" or name == prefix or name.startswith(prefix + ".")))


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, sub.end_lineno + 1))
    return lines


def imports_of(module: str) -> list[tuple[str, list[str], int]]:
    """(imported reshard module, names taken from it, line) for every runtime import of
    ``module``, at module level or inside functions (``TYPE_CHECKING`` blocks aside)."""
    tree = ast.parse(MODULES[module].read_text())
    skip = _type_checking_lines(tree)
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "reshard":
                out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level:
            out.append(("<relative>", [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names
                       if a.name.split(".")[0] == "reshard")
    return out


def _target(imported: str, names: list[str]) -> list[str]:
    """The modules an import loads: ``from reshard.x import y`` may name a submodule."""
    subs = [f"{imported}.{n}" for n in names if f"{imported}.{n}" in MODULES]
    return subs or [imported]


def graph() -> dict[str, set[str]]:
    return {m: {t for imp, names, _ in imports_of(m) for t in _target(imp, names)
                if t != m} for m in MODULES}


#: Packages of the optional extras (pyproject.toml): a module that needs one may be
#: left unimported where it is not installed (``make test`` installs them all).
OPTIONAL = {"vllm", "megatron", "ray", "rich", "matplotlib", "transformers", "trl", "accelerate",
            "datasets"}


def test_every_module_imports():
    missing = []
    for module in MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in OPTIONAL:
                raise
            missing.append(f"{module} (needs {e.name})")
    if missing:
        pytest.skip(f"optional packages not installed: {', '.join(missing)}")


def test_imports_are_absolute_and_known():
    bad = [(m, imp, line) for m in MODULES for imp, _, line in imports_of(m)
           if imp == "<relative>" or imp not in MODULES]
    assert not bad, bad


def test_layers_import_only_downwards():
    bad = []
    for module in MODULES:
        if module == "reshard":  # the front door re-exports; its heavy names load lazily
            continue
        mine = layer(module)
        for imp, names, line in imports_of(module):
            for target in _target(imp, names):
                theirs = layer(target)
                if theirs != mine and theirs not in ALLOWED[mine]:
                    bad.append(f"{module}:{line} ({mine}) imports {target} ({theirs})")
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in g:
        if v not in index:
            visit(v)
    assert not circles, circles


#: An engine's package (``integrations/<engine>/``): its door (``__init__``) loads its names
#: on first use, and the modules beneath it that need no engine import none of those that
#: do, so they load without it (the mapping, its rules, FP8 checkpoints).
ENGINE_PACKAGES = {"reshard.integrations.vllm": ("mapping", "rules", "fp8")}


def test_engine_packages_keep_their_rooms():
    bad = []
    for package, pure in ENGINE_PACKAGES.items():
        inside = [m for m in MODULES if m.startswith(package + ".")]
        bad += [f"{m} imports its package's door" for m in inside
                for imp, names, _ in imports_of(m) if package in _target(imp, names)]
        bad += [f"{package} imports {imp} when it loads" for imp, _, _ in imports_of(package)]
        allowed = {f"{package}.{p}" for p in pure}
        bad += [f"{m} imports {t}" for m in allowed for imp, names, _ in imports_of(m)
                for t in _target(imp, names) if t.startswith(package + ".") and t not in allowed]
    assert not bad, "\n".join(bad)


def test_transport_stays_behind_the_executor():
    bad = [(m, imp) for m in MODULES for imp, _, _ in imports_of(m)
           if imp.startswith("reshard._transport") and not (
               m == "reshard.executor" or m.startswith("reshard._transport"))]
    assert not bad, bad


def test_no_private_name_crosses_modules():
    bad = [(m, imp, n) for m in MODULES for imp, names, _ in imports_of(m)
           for n in names if n.startswith("_")]
    assert not bad, bad


def test_each_constant_defined_once():
    seen: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])
            for t in targets:
                if isinstance(t, ast.Name) and t.id.isupper() and not t.id.startswith("_"):
                    seen.setdefault(t.id, []).append(module)
    twice = {name: where for name, where in seen.items() if len(where) > 1}
    assert not twice, twice


def test_user_errors_are_reshard_errors():
    """No bare ``ValueError`` / ``TypeError`` raised and no exception class defined outside
    ``reshard.errors`` in the library (the tools may define their own)."""
    bad = []
    for module, path in MODULES.items():
        if layer(module) == "tools":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = ast.unparse(node.exc.func)
                if name in ("ValueError", "TypeError"):
                    bad.append(f"{module}:{node.lineno} raises {name}")
            if (isinstance(node, ast.ClassDef) and module != "reshard.errors"
                    and any(ast.unparse(b).endswith(("Error", "Exception")) for b in node.bases)):
                bad.append(f"{module}:{node.lineno} defines {node.name}")
    assert not bad, "\n".join(bad)


def test_no_module_shadows_a_function_of_its_package():
    """``reshard.plan`` is the planner function; no module of that name hides it."""
    for module in MODULES:
        parent, _, leaf = module.rpartition(".")
        if parent in MODULES:
            pkg = importlib.import_module(parent)
            value = getattr(pkg, leaf, None)
            assert value is None or type(value).__name__ == "module", module


@pytest.mark.parametrize("lay", TORCH_FREE)
def test_core_and_simulator_import_without_torch(lay):
    names = [m for m in MODULES if layer(m) == lay]
    code = (f"import sys; import {', '.join(names)}; "
            "print('torch' in sys.modules, 'torch.distributed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"], names


def test_top_level_names_load_lazily():
    code = ("import sys, reshard; before = 'torch.distributed' in sys.modules; "
            "reshard.redistribute, reshard.Executor, reshard.RefitSender, reshard.RefitReceiver;"
            " print(before, 'torch.distributed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True"]
    assert set(reshard.__all__) <= set(dir(reshard))


def test_readme_module_map_matches_the_tree():
    """Every module is in the README's map, and the map names no module that is gone."""
    readme = (SRC.parent.parent / "README.md").read_text()
    section = readme[readme.index("## How it is built"):]
    first_cells = [line.split("|")[1] for line in section.splitlines()
                   if line.startswith("| `")]
    listed = set(re.findall(r"`([\w/]+\.py)`", "\n".join(first_cells)))
    files = {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")
             if p.name != "__init__.py" or p.parent == SRC}
    assert listed == files, {"not in the README": sorted(files - listed),
                             "in the README only": sorted(listed - files)}
