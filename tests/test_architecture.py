"""The import rule of docs/ARCHITECTURE.md, read from the source: every module under `quantspec/`
is parsed (imports inside functions included) and each arrow between rooms must point downward:

    cli → api → {serve, report} → infer → kernels → quant → model_zoo,   api → calib → quant,
    api → distill → {calib, infer}

The top-level helpers (`errors`, `outputs`, `console`, `devices`, `threads`, `paths`) are leaves
anyone may import, and they import only each other. Inside `infer/`, the engine, the scheduler,
the proposers, the cache and the loader know no backend: only `infer/backend.py` enters the
device rooms (`infer/cpu/`, `infer/cuda/`).

The size rule, read the same way: no module over 500 lines and no function over 60 outside
`kernels/`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "quantspec"

LEAVES = {"errors", "outputs", "console", "devices", "threads", "paths", "sizes", "__init__"}
# each room's direct arrows; a room may import everything they reach
ARROWS = {
    "cli": {"api"},
    "api": {"serve", "report", "calib", "distill"},
    "distill": {"calib", "infer"},
    "serve": {"infer"},
    "report": {"infer"},
    "infer": {"kernels"},
    "kernels": {"quant"},
    "calib": {"quant"},
    "quant": {"model_zoo"},
    "model_zoo": set(),
}
# infer's modules that know no backend (module paths relative to quantspec/infer)
BACKEND_FREE = ("engine.py", "scheduler.py", "sequence.py", "kv_cache.py", "predictor.py", "sampler.py", "evaluate.py",
                "hidden.py", "loader.py", "fuse.py", "quant_linear.py", "spec/")
BACKEND_ROOMS = ("quantspec.infer.cpu", "quantspec.infer.cuda", "quantspec.kernels.cpu")


def _below(room: str) -> set[str]:
    seen, todo = set(), list(ARROWS.get(room, ()))
    while todo:
        r = todo.pop()
        if r not in seen:
            seen.add(r)
            todo.extend(ARROWS.get(r, ()))
    return seen


def _module_name(path: Path) -> list[str]:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _is_submodule(name: str) -> bool:
    return (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every import in the file, relative ones resolved; `from
    quantspec import x` counts as importing `quantspec.x`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = _module_name(path)
                package = here if path.name == "__init__.py" else here[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base == "quantspec":  # a submodule, or a name of the package itself (__version__)
                out += [(node.lineno, f"quantspec.{a.name}" if _is_submodule(a.name) else "quantspec")
                        for a in node.names]
            else:
                out.append((node.lineno, base))
    return [(line, name) for line, name in out if name == "quantspec" or name.startswith("quantspec.")]


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_room_is_known():
    rooms = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in SOURCES}
    assert rooms <= LEAVES | set(ARROWS), sorted(rooms - LEAVES - set(ARROWS))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_downward(path):
    room = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    allowed = LEAVES if room in LEAVES else LEAVES | {room} | _below(room)
    wrong = [f"line {line}: {name}" for line, name in _imports(path) if _room(name) not in allowed]
    assert not wrong, f"{path.relative_to(PACKAGE)} ({room}) imports above or beside it: {wrong}"


GENERIC_INFER = [p for p in SOURCES if p.is_relative_to(PACKAGE / "infer")
                 and p.relative_to(PACKAGE / "infer").as_posix().startswith(BACKEND_FREE)]


@pytest.mark.parametrize("path", GENERIC_INFER, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_generic_runtime_knows_no_backend(path):
    wrong = [f"line {line}: {name}" for line, name in _imports(path)
             if name.startswith(BACKEND_ROOMS)]
    assert not wrong, f"{path.relative_to(PACKAGE)} imports a device backend (use infer.backend): {wrong}"


CLI_RENDERERS = ("quantspec.report.render",)  # the report's rich table


@pytest.mark.parametrize("path", sorted((PACKAGE / "cli").glob("*.py")), ids=lambda p: p.name)
def test_the_cli_imports_only_api_and_renderers(path):
    """A command builds its config with what `api` hands out (`api.InferConfig`, ...), calls one
    `api` function and renders the result: nothing of the rooms below is imported directly."""
    ok = {"quantspec", "quantspec.api"} | {f"quantspec.{leaf}" for leaf in LEAVES} | set(CLI_RENDERERS)
    wrong = [f"line {line}: {name}" for line, name in _imports(path)
             if name not in ok and not name.startswith("quantspec.cli")]
    assert not wrong, f"cli/{path.name} imports below api: {wrong}"


def test_the_rule_catches_a_sideways_arrow(tmp_path):
    """The checks above can fail: kernels importing infer, and infer importing calib."""
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from quantspec.infer import engine\n    import quantspec.calib.runner\n")
    names = [_room(n) for _, n in _imports(bad)]
    assert names == ["infer", "calib"]
    assert "infer" not in _below("kernels") and "calib" not in _below("infer")
    assert {"serve", "report", "infer", "kernels", "quant", "model_zoo", "calib", "distill"} == _below("api")



# The size rule: no module over MAX_FILE_LINES lines and no function or method (a nested one
# measured on its own) over MAX_FUNCTION_LINES, outside kernels/ (Triton and C++ bindings).
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
SIZED = [p for p in SOURCES if not p.is_relative_to(PACKAGE / "kernels")]


def _oversized(path: Path, source: str) -> list[tuple[str, str]]:
    """[(what, its size)] of what in `source` breaks the size rule: the file ("engine.py") and
    each function ("gptq.py:_gptq"), named relative to the package."""
    name = path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else path.name
    found = []
    lines = len(source.splitlines())
    if lines > MAX_FILE_LINES:
        found.append((name, f"{lines} lines"))
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            size = node.end_lineno - node.lineno + 1
            if size > MAX_FUNCTION_LINES:
                found.append((f"{name}:{node.name}", f"{size} lines from line {node.lineno}"))
    return found


def test_files_and_functions_stay_small():
    over = [f"{what} ({size})" for p in SIZED for what, size in _oversized(p, p.read_text())]
    assert not over, (f"{len(over)} over the size rule ({MAX_FILE_LINES} lines a module, "
                      f"{MAX_FUNCTION_LINES} a function; split by concept), first: {over[:10]}")


def test_the_size_rule_catches_a_long_function_and_file(tmp_path):
    """The scan above can fail: a 61-line function, a 61-line function nested in another, and a
    501-line file; a 60-line function passes."""
    def statements(indent: int, n: int) -> str:
        return (" " * indent + "x = 1\n") * n

    src = ("def long():\n" + statements(4, MAX_FUNCTION_LINES) + "\n"
           "def outer():\n    def inner():\n" + statements(8, MAX_FUNCTION_LINES) + "    return inner\n")
    src += "\n" * (MAX_FILE_LINES + 1 - len(src.splitlines()))
    over = _oversized(tmp_path / "big.py", src)
    assert over == [("big.py", "501 lines"), ("big.py:long", "61 lines from line 1"),
                    ("big.py:outer", "63 lines from line 63"), ("big.py:inner", "61 lines from line 64")], over
    assert _oversized(tmp_path / "ok.py", "def short():\n" + statements(4, MAX_FUNCTION_LINES - 1)) == []
