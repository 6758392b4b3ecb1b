"""The API surface of CuPy (real or CI's stand-in) and the part of it that
mpicube calls, for tests/test_cupy_api.py.

``surface()`` walks the namespaces mpicube and the stand-in touch (cupy,
cupyx, cupy.cuda, cupy.cuda.runtime, cupy.ndarray and cupy.cuda's Device,
Stream and Event) and records each public name with its parameters where
``inspect`` can read them (CuPy's Cython functions often hide theirs:
recorded as None, checked by name only). ``uses()`` reads mpicube's source
(its AST, not a regex) for attribute chains on ``cupy``, ``cupyx``, ``xp``
and ``_cp()``, and for ``from cupy... import`` lines.

The record of real CuPy 14 is tests/fake_gpu/cupy14_api.json, written by

    pip download --no-deps cupy-cuda13x==14.2.0 fastrlock cuda-pathfinder
    pip install --no-deps --target SITE *.whl
    PYTHONPATH=SITE python tests/cupy_api.py dump tests/fake_gpu/cupy14_api.json WHEEL

CuPy imports without a GPU or a driver (only calls into the runtime fail),
so this runs anywhere. Modules that need a CUDA library to import
(cupy_backends.cuda.libs.cublas needs libcublasLt) are recorded by the
names mpicube uses that occur as identifiers in the module's shared object.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["cupy", "cupyx", "cupy.cuda", "cupy.cuda.runtime", "cupy.cuda.device", "cupy._core._routines_linalg"]
CLASSES = ["cupy.ndarray", "cupy.cuda.Device", "cupy.cuda.Stream", "cupy.cuda.Event"]
UNIMPORTABLE = ["cupy_backends.cuda.libs.cublas"]          # needs libcublasLt.so to import


def _params(obj):
    """[[name, kind, has default], ...] or None where inspect cannot tell."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [[p.name, p.kind.name, p.default is not inspect.Parameter.empty] for p in sig.parameters.values()]


def _entry(obj) -> dict:
    if inspect.ismodule(obj):
        return {"kind": "module", "params": None}
    if inspect.isclass(obj):
        return {"kind": "class", "params": None}
    if callable(obj):
        return {"kind": "callable", "params": _params(obj)}
    return {"kind": "value", "params": None}


def surface(stand_in_only_public: bool = True) -> dict:
    """{qualified name: {"kind", "params"}} of the importable namespaces."""
    out = {}
    for mod_name in MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        out[mod_name] = _entry(mod)
        for name in dir(mod):
            if name.startswith("_"):
                continue
            obj = getattr(mod, name)
            if inspect.ismodule(obj) and f"{mod_name}.{name}" not in MODULES:
                # a submodule is API (cupy.linalg); a module-level `import os` is not
                if not getattr(obj, "__name__", "").startswith(("cupy", "cupyx")):
                    continue
            if name == "annotations" and getattr(obj, "__class__", type(None)).__name__ == "_Feature":
                continue
            out[f"{mod_name}.{name}"] = _entry(obj)
    for cls_name in CLASSES:
        mod_name, _, attr = cls_name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError):
            continue
        for name in dir(cls):
            if not name.startswith("_") or name in ("__cuda_array_interface__", "__dlpack__"):
                out[f"{cls_name}.{name}"] = _entry(getattr(cls, name, None))
    return out


# --- what mpicube calls -------------------------------------------------------------
_ROOTS = {"cupy": "cupy", "cupyx": "cupyx", "xp": "cupy", "cp": "cupy"}
NUMPY_ONLY = {"cupy.vecdot": "ops.local guards it with hasattr: NumPy 2 has it, CuPy 14 does not"}


def _chain(node):
    """'a.b.c' for an Attribute chain rooted at a Name (or ``_cp()``), else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_cp":
        root = "cupy"
    elif isinstance(node, ast.Name) and node.id in _ROOTS:
        root = _ROOTS[node.id]
    else:
        return None
    return ".".join([root] + parts[::-1])


def uses(package: Path = ROOT / "mpicube") -> dict:
    """{qualified CuPy name: ["file:line", ...]} that mpicube's source calls
    or reads, longest known prefix kept (cupy.cuda.runtime.getDeviceCount)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        aliases = {}                    # local name -> qualified CuPy modules (a fallback import adds one)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in (
                    "cupy", "cupyx", "cupy_backends"):
                for a in node.names:
                    qual = f"{node.module}.{a.name}"
                    aliases.setdefault(a.asname or a.name, []).append(qual)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or isinstance(getattr(node, "parent", None), ast.Attribute):
                continue
            name = _chain(node)
            if name is None and isinstance(node.value, ast.Name) and node.value.id in aliases:
                name = " | ".join(f"{q}.{node.attr}" for q in aliases[node.value.id])
            if name is None or name.endswith(".__name__"):
                continue
            found.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
        for local, quals in aliases.items():
            found.setdefault(" | ".join(quals), []).append(f"{path.relative_to(ROOT)} (import)")
    # keep only the outermost chain of each expression: a.b.c also walks a.b
    return {k: v for k, v in found.items() if not any(o.startswith(k + ".") and set(v) <= set(found[o])
                                                      for o in found if o != k)}


def dump(out_path: str, wheel: str) -> None:
    """Record the importable CuPy's surface (run with the real CuPy importable)."""
    import cupy

    record = surface()
    libs = {}
    for mod_name in UNIMPORTABLE:
        so = next((Path(cupy.__file__).parents[1] / mod_name.replace(".", "/")).parent.glob(
            mod_name.rsplit(".", 1)[1] + ".*.so"))
        words = set(re.findall(rb"[A-Za-z_][A-Za-z0-9_]{3,}", so.read_bytes()))
        wanted = {n.rsplit(".", 1)[1] for alt in uses() for n in alt.split(" | ") if n.startswith(mod_name + ".")}
        for name in sorted(wanted):
            if name.encode() in words:
                record[f"{mod_name}.{name}"] = {"kind": "in shared object", "params": None}
        record[mod_name] = {"kind": "module (shared object)", "params": None}
        libs[mod_name] = so.name
    digest = hashlib.sha256(Path(wheel).read_bytes()).hexdigest()
    provenance = {"cupy": cupy.__version__, "wheel": Path(wheel).name, "sha256": digest,
                  "by_name_only": libs, "how": "tests/cupy_api.py dump (see its docstring)"}
    lines = [f"  {json.dumps(k)}: {json.dumps(record[k], separators=(',', ':'))}" for k in sorted(record)]
    Path(out_path).write_text('{"provenance": ' + json.dumps(provenance, sort_keys=True) + ',\n "names": {\n'
                              + ",\n".join(lines) + "\n}}\n")


if __name__ == "__main__":
    if sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "surface":
        print(json.dumps(surface()))
    elif sys.argv[1] == "uses":
        print(json.dumps(uses(), indent=1))
