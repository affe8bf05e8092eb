"""Every Python example of the README and of docs/ runs as written, or at least names
only what exists.

Each ```python block carries a marker on the line above it:

- ``<!-- example: NAME run: python -->``: run with ``python``, must exit 0;
- ``<!-- example: NAME run: torchrun N -->``: run under ``torchrun --standalone`` on N
  gloo processes, must exit 0;
- ``<!-- example: NAME check: names -->``: a sketch that needs a real cluster, engine or
  trainer (vLLM, Megatron, Ray): it must compile, every module and name it imports must
  exist, attribute chains on them must resolve, calls to them must bind to their
  signatures (a keyword that is not accepted fails), strings naming a ``reshard.``
  object must name a real one, and ``collective(llm, "reshard_...", ...)`` must name a
  method of vLLM worker extension and bind to it. The integration tests run the real
  thing (tests/integration/test_vllm_refit.py, test_megatron_refit.py,
  test_ray_refit.py).

The examples assert what they claim themselves; the one-call example's output is also
checked here.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- example: (?P<name>[\w-]+) (?P<how>run: python|run: torchrun "
                    r"(?P<nproc>\d+)|check: names) -->\n```python\n(?P<code>.*?)```", re.S)


def examples() -> list[tuple[str, str, str, str]]:
    """(page:name, how, nproc or "", code) for every marked block of every page."""
    out = []
    for page in PAGES:
        for m in MARKER.finditer(page.read_text()):
            out.append((f"{page.relative_to(ROOT)}:{m['name']}", m["how"], m["nproc"] or "",
                        m["code"]))
    return out


EXAMPLES = examples()
RUN = [e for e in EXAMPLES if e[1].startswith("run")]
CHECK = [e for e in EXAMPLES if e[1] == "check: names"]


def test_every_python_block_is_marked():
    """No Python example escapes: each ```python block of each page has a marker."""
    for page in PAGES:
        text = page.read_text()
        assert text.count("```python\n") == len(MARKER.findall(text)), page.name
    assert len({e[0] for e in EXAMPLES}) == len(EXAMPLES), "example names repeat"
    assert "README.md:one-call" in {e[0] for e in RUN}


def _run(key: str, how: str, nproc: str, code: str, cwd: Path) -> str:
    script = cwd / (key.split(":")[1] + ".py")
    script.write_text(code)
    cmd = ([sys.executable, str(script)] if how == "run: python" else
           [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", nproc, str(script)])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("key,how,nproc,code", RUN, ids=[e[0] for e in RUN])
def test_example_runs_as_written(key, how, nproc, code, tmp_path):
    out = _run(key, how, nproc, code, tmp_path)
    if key == "README.md:one-call":
        # four processes share one stdout: a line's newline may land after another's text
        said = sorted(re.findall(r"rank \d: \(Replicate\(\), Shard\(dim=1\)\) \(8, 4\), "
                                 r"wo \(8, 4\)", out))
        assert said == [f"rank {r}: (Replicate(), Shard(dim=1)) (8, 4), wo (8, 4)"
                        for r in range(4)], out


# --- check: names ---------------------------------------------------------------------

def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _attr(obj: Any, name: str) -> Any:
    if hasattr(obj, name):
        return getattr(obj, name)
    if inspect.ismodule(obj):  # a submodule not imported yet
        return importlib.import_module(f"{obj.__name__}.{name}")
    raise AttributeError(name)


def _bind(obj: Any, call: ast.Call, skip: int = 0) -> str | None:
    """Why ``call`` cannot call ``obj`` (its positional count and keywords), or None."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    starred = any(isinstance(a, ast.Starred) for a in call.args) or any(
        k.arg is None for k in call.keywords)
    args = [None] * (len(call.args) - skip)
    kwargs = {k.arg: None for k in call.keywords if k.arg is not None}
    try:
        (sig.bind_partial if starred else sig.bind)(*args, **kwargs)
    except TypeError as e:
        return f"{ast.unparse(call)}: {e}"
    return None


def name_problems(code: str) -> list[str]:
    """What in ``code`` names something that does not exist (see the module's doc)."""
    tree = ast.parse(code)
    bound: dict[str, Any] = {}  # a name (or dotted target) -> the object it holds
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _importable(a.name, problems):
                    top = a.name.split(".")[0]
                    bound[a.asname or top] = importlib.import_module(a.asname and a.name or top)
        elif isinstance(node, ast.ImportFrom) and _importable(node.module, problems):
            module = importlib.import_module(node.module)
            for a in node.names:
                try:
                    bound[a.asname or a.name] = _attr(module, a.name)
                except (AttributeError, ModuleNotFoundError):
                    problems.append(f"from {node.module} import {a.name}: no such name")
    for node in ast.walk(tree):  # x = SomeClass(...): x.method(...) is checked on the class
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and len(node.targets) == 1):
            cls = _resolve(node.value.func, bound, [])
            if inspect.isclass(cls):
                bound[ast.unparse(node.targets[0])] = ("instance", cls)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            _resolve(node, bound, problems)
        elif isinstance(node, ast.Call):
            problems.extend(_call_problems(node, bound))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and re.fullmatch(r"reshard(\.\w+)+", node.value)):
            problems.extend(_dotted_problems(node.value))
    return problems


def _importable(module: str, problems: list[str]) -> bool:
    """Whether ``module`` imports; a missing reshard module is a problem, a missing
    optional package (vLLM, Ray, Megatron) raises ModuleNotFoundError (a skip)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "reshard":
            raise
        problems.append(f"import {module}: no module {e.name}")
        return False
    return True


def _resolve(node: ast.AST, bound: dict[str, Any], problems: list[str]) -> Any:
    """The object ``node`` (a name or attribute chain) holds, where its root is known."""
    chain = _chain(node)
    if chain is None:
        return None
    for i in range(len(chain), 0, -1):  # the longest known prefix (``self.sender``)
        root = ".".join(chain[:i])
        if root in bound:
            break
    else:
        return None
    obj = bound[root]
    for name in chain[i:]:
        instance = isinstance(obj, tuple) and obj[0] == "instance"
        where = obj[1] if instance else obj
        if not hasattr(where, name) and not inspect.ismodule(where):
            problems.append(f"{'.'.join(chain)}: {root} has no {name!r}")
            return None
        try:
            obj = _attr(where, name)
        except (AttributeError, ModuleNotFoundError):
            problems.append(f"{'.'.join(chain)}: {root} has no {name!r}")
            return None
        if instance:
            obj = ("method", obj)
    return obj


def _call_problems(call: ast.Call, bound: dict[str, Any]) -> list[str]:
    target = _resolve(call.func, bound, [])
    if target is None:
        return []
    if isinstance(target, tuple):  # a method of an instance: self comes first
        problem = _bind(target[1], call, skip=-1)
        return [problem] if problem else []
    problems = []
    problem = _bind(target, call)
    if problem:
        problems.append(problem)
    if getattr(target, "__qualname__", "") == "collective" and len(call.args) >= 2:
        problems.extend(_collective_problems(target, call))
    return problems


def _collective_problems(collective: Any, call: ast.Call) -> list[str]:
    """``collective(llm, "reshard_x", *args)``: reshard_x is a worker method taking them."""
    method = call.args[1]
    if not isinstance(method, ast.Constant):
        return []
    extension = importlib.import_module("reshard.integrations.vllm").ReshardWorkerExtension
    fn = getattr(extension, method.value, None)
    if fn is None:
        return [f"{ast.unparse(call)}: the worker extension has no {method.value!r}"]
    inner = ast.Call(func=call.func, args=call.args[2:], keywords=[
        k for k in call.keywords if k.arg != "timeout"])
    problem = _bind(inspect.unwrap(fn), inner, skip=-1)
    return [problem] if problem else []


def _dotted_problems(dotted: str) -> list[str]:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        try:
            for name in parts[i:]:
                obj = _attr(obj, name)
        except (AttributeError, ModuleNotFoundError):
            return [f"{dotted!r} names nothing"]
        return []
    return [f"{dotted!r} names nothing"]


def problems_apart(codes: list[str]) -> list[list[str]]:
    """:func:`name_problems` of each code in one fresh process (imports of vLLM, Ray or
    Megatron stay out of the test process); skips where an optional package is missing."""
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(codes),
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout.splitlines()[-1])
    if answer.get("missing"):
        pytest.skip(f"{answer['missing']} is not installed (make test installs it)")
    return answer["problems"]


BAD = '''
from reshard.refit import RefitSender
from reshard.integrations.vllm import collective
import reshard as R
sender = RefitSender({}, hots="x", port=1, rank=0, trainer_size=1, inference_size=1)
sender.refitt(1)
collective(llm, "reshard_nope")
collective(llm, "reshard_init", "h", 1, 2, colour=3)
R.Layoutt
x = "reshard.integrations.vllm.NoSuchExtension"
from reshard.integrations.nothing import x
'''
GOOD = BAD.split("sender = ")[0] + (
    'sender = RefitSender({}, host="h", port=1, rank=0, trainer_size=1, inference_size=1)\n'
    'sender.refit(1)\ncollective(llm, "reshard_init", "h", 1, 2)\n')


@pytest.fixture(scope="module")
def checked() -> dict[str, list[str]]:
    """Problems by example key (and of BAD and GOOD), found in one process."""
    keys = ["BAD", "GOOD", *(e[0] for e in CHECK)]
    return dict(zip(keys, problems_apart([BAD, GOOD, *(e[3] for e in CHECK)])))


def test_name_check_finds_what_is_wrong(checked):
    """The checker itself fails on a wrong keyword, name, method, module or dotted string."""
    problems = "\n".join(checked["BAD"])
    for wrong in ("hots", "refitt", "reshard_nope", "colour", "Layoutt", "NoSuchExtension",
                  "reshard.integrations.nothing"):
        assert wrong in problems, (wrong, problems)
    assert checked["GOOD"] == []


@pytest.mark.parametrize("key,how,nproc,code", CHECK, ids=[e[0] for e in CHECK])
def test_sketch_names_resolve(key, how, nproc, code, checked):
    compile(code, key, "exec")
    assert not checked[key], "\n".join(checked[key])


if __name__ == "__main__":  # python test_readme_example.py < code: one JSON line
    sources = json.loads(sys.stdin.read())
    try:
        print(json.dumps({"problems": [name_problems(code) for code in sources]}))
    except ModuleNotFoundError as e:
        print(json.dumps({"missing": e.name}))
