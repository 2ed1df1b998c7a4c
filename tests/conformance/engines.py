"""Fetch the pinned engines' wheels and the compressed-tensors releases they pin, cached.

`ENGINE_PINS` is the one place a pinned engine version lives (bump it there and in
`quant.engines.ENGINE_VERSIONS`, which the suite checks are the same). Everything goes under
`cache_dir()` (`$QUANTSPEC_CONFORMANCE_CACHE`, default `~/.cache/quantspec/conformance`):
`wheels/` (pip download --no-deps), `src/<engine>-<version>/` (the wheel's .py files only), and
`ct/<version>/` (pip install --no-deps --target). A wheel that cannot be downloaded raises
`Unavailable` with the reason, which the suite turns into a skip of that engine's cases.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from quantspec.quant.engines import ENGINE_VERSIONS

ENGINE_PINS = {"vllm": "0.33.0", "sglang": "0.5.23"}
# where each engine's Llama lives in its wheel (its fused-layer mapping and layer classes)
MODEL_FILES = {"vllm": "vllm/model_executor/models/llama.py", "sglang": "sglang/srt/models/llama.py"}
LIFT = Path(__file__).with_name("lift.py")


class Unavailable(Exception):
    """An engine's wheel or pinned compressed-tensors could not be fetched here."""


def cache_dir() -> Path:
    d = os.environ.get("QUANTSPEC_CONFORMANCE_CACHE")
    return Path(d) if d else Path.home() / ".cache" / "quantspec" / "conformance"


def _pip(*args: str) -> None:
    # a short timeout and few retries: without a route to the package index the suite skips the
    # engine's cases after about a minute instead of pip's default backoff
    r = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "--timeout", "30",
                        "--retries", "2", *args],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise Unavailable(f"pip {' '.join(args[:3])} failed: {tail[0][:200]}")


class EngineSource:
    """One pinned engine: its wheel's Python source, the compressed-tensors it pins, and what
    fetching them cost (`timings`, seconds; `wheel_bytes`)."""

    def __init__(self, engine: str):
        self.engine, self.version = engine, ENGINE_PINS[engine]
        self.timings: dict[str, float] = {}
        root = cache_dir()
        wheels = root / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        found = sorted(wheels.glob(f"{engine}-{self.version}-*.whl"))
        if not found:
            t0 = time.perf_counter()
            _pip("download", "--no-deps", "--only-binary=:all:", f"{engine}=={self.version}",
                 "-d", str(wheels))
            self.timings["download"] = time.perf_counter() - t0
            found = sorted(wheels.glob(f"{engine}-{self.version}-*.whl"))
            if not found:
                raise Unavailable(f"pip download of {engine}=={self.version} gave no wheel")
        self.wheel = found[0]
        self.wheel_bytes = self.wheel.stat().st_size
        self.source = root / "src" / f"{engine}-{self.version}"
        if not (self.source / ".complete").is_file():
            t0 = time.perf_counter()
            with zipfile.ZipFile(self.wheel) as z:
                for n in z.namelist():
                    if n.endswith(".py") and n.startswith(f"{engine}/"):
                        z.extract(n, self.source)
                meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
                (self.source / "METADATA").write_bytes(z.read(meta))
            (self.source / ".complete").write_text("")
            self.timings["extract"] = time.perf_counter() - t0
        self.ct_version = pinned_compressed_tensors(self.source / "METADATA")
        self.ct_dir = compressed_tensors_dir(self.ct_version)

    def model_source(self) -> str:
        return (self.source / MODEL_FILES[self.engine]).read_text()

    def architectures(self) -> set[str]:
        """The model classes the engine can build, read from its source (a superset: vLLM's
        registry keys, every class of an SGLang model file that declares an `EntryClass`)."""
        if self.engine == "vllm":
            text = (self.source / "vllm/model_executor/models/registry.py").read_text()
            return set(re.findall(r'^\s+"(\w+)":\s*\(', text, re.M))
        out: set[str] = set()
        for f in (self.source / "sglang/srt/models").glob("*.py"):
            text = f.read_text(errors="replace")
            if "EntryClass" in text:
                out |= set(re.findall(r"^class (\w+)\(", text, re.M))
        return out

    def speculative_methods(self) -> set[str]:
        """The speculative-decoding methods the engine's config accepts, read from its source
        (vLLM: every string of a `Literal[...]` in its speculative config, a superset of
        `SpeculativeConfig.method`; SGLang: the members of `SpeculativeAlgorithm`)."""
        if self.engine == "vllm":
            tree = ast.parse((self.source / "vllm/config/speculative.py").read_text())
            return {n.value for sub in ast.walk(tree) if isinstance(sub, ast.Subscript)
                    and isinstance(sub.value, ast.Name) and sub.value.id == "Literal"
                    for n in ast.walk(sub.slice) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        tree = ast.parse((self.source / "sglang/srt/speculative/spec_info.py").read_text())
        cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "SpeculativeAlgorithm")
        return {t.id for stmt in cls.body if isinstance(stmt, ast.Assign) for t in stmt.targets
                if isinstance(t, ast.Name)}

    def files_mentioning(self, word: str) -> list[str]:
        """The wheel's .py files whose text contains `word` (case-insensitive)."""
        return sorted(str(f.relative_to(self.source)) for f in self.source.rglob("*.py")
                      if word.lower() in f.read_text(errors="replace").lower())

    def packed_modules_mapping(self) -> dict:
        """The Llama class's `packed_modules_mapping` as its model file writes it ({} when it
        declares none: the loader then takes `getattr(model_class, ..., {})`)."""
        return class_literal(self.model_source(), "LlamaForCausalLM", "packed_modules_mapping") or {}

    def run(self, request: dict, tmp: Path, script: Path = LIFT) -> dict:
        """Run `script` (`lift.py`, or another driver taking the same arguments) on `request` in
        a fresh interpreter; → its JSON."""
        req = tmp / f"request-{self.engine}-{script.stem}.json"
        req.write_text(json.dumps(request))
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, str(script), self.engine, str(self.source), str(self.ct_dir),
                            str(req)], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONNOUSERSITE": "1"})
        self.timings["run"] = time.perf_counter() - t0
        if r.returncode != 0 or not r.stdout.strip():
            raise RuntimeError(f"{script.name} {self.engine} failed:\n{r.stderr[-3000:]}")
        out = json.loads(r.stdout)
        if "fatal" in out:
            raise RuntimeError(f"{script.name} {self.engine}:\n{out['fatal']}")
        return out


def run_engines(engine_sources: dict, request_for, tmp: Path, script: Path = LIFT) -> dict:
    """engine → `script`'s answer to `request_for(source)` (or the reason the engine is unavailable,
    as `engine_sources` gives it)."""
    return {engine: src if isinstance(src, str) else src.run(request_for(src), tmp, script)
            for engine, src in engine_sources.items()}


def pinned_compressed_tensors(metadata: Path) -> str:
    """The `compressed-tensors==X` an engine's wheel requires (its METADATA)."""
    for line in metadata.read_text(errors="replace").splitlines():
        if line.startswith("Requires-Dist:") and "compressed-tensors" in line:
            spec = line.split(":", 1)[1].split(";")[0].strip()
            if "==" in spec:
                return spec.split("==", 1)[1].strip()
    raise Unavailable(f"{metadata} pins no compressed-tensors==X")


def compressed_tensors_dir(version: str) -> Path:
    """compressed-tensors `version` installed alone (no dependencies) into a cached directory."""
    d = cache_dir() / "ct" / version
    if not (d / ".complete").is_file():
        _pip("install", "--no-deps", "--target", str(d), f"compressed-tensors=={version}")
        (d / ".complete").write_text("")
    return d


def class_literal(source: str, cls: str, attr: str):
    """The literal value of `attr` in the body of class `cls` of a Python source (None if absent)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for stmt in node.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                    [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
                if any(isinstance(t, ast.Name) and t.id == attr for t in targets) and stmt.value is not None:
                    return ast.literal_eval(stmt.value)
    return None


def layer_classes(source: str) -> dict[str, str]:
    """`self.<attr> = <Class>(...)` in a model file → {attr: class name}."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            f = node.value.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            for t in node.targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" \
                        and name is not None:
                    out.setdefault(t.attr, name)
    return out


def pins_agree() -> bool:
    return all(ENGINE_VERSIONS[e] == v for e, v in ENGINE_PINS.items())


def compiled_defs(path: Path, names: tuple[str, ...], namespace: dict) -> dict:
    """The top-level functions and classes `names` of the engine's file at `path` ("Class.method":
    that method, as a plain function), compiled alone with `namespace` as their globals (what
    their code reads from the imports it is cut from): the engine's own pure code, run without
    importing its module. Returns `namespace`, holding them."""
    tree = ast.parse(path.read_text())
    top = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    body = []
    for name in names:
        cls, _, method = name.rpartition(".")
        node = top.get(cls or method)
        if cls and node is not None:
            node = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method), None)
        assert node is not None, f"{path.name} has no {name}"
        body.append(node)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102 — its code
    return namespace
