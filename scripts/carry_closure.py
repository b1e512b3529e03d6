"""What the slimmed GPU carry must hold: the static import closure of the modules crossrl's
vLLM engine loads, over the carried wheels (stdlib only, Python 3.10+).

    python scripts/carry_closure.py WHEEL_DIR ROOTS_FILE [--dropped DIR] [--root MODULE ...]

``ROOTS_FILE``: module names, one per line (``scripts/vllm_engine_modules.txt``, traced by
``scripts/trace_vllm_modules.py`` on the vLLM CPU lane); ``--root``: more (the CUDA-only
modules the CPU lane cannot load). From those roots, every import that runs when a module is
imported is followed through the wheels' sources: module-level and class-level statements,
``if`` branches included, not those inside functions or under ``if TYPE_CHECKING``. An import
inside a ``try`` block or under an ``if`` that asks whether a package is there (``GUARDS``) is
optional: followed where its package is carried, never a failure where it is not. The check fails (exit 1) when a
reached module imports a package that only a dropped wheel (``--dropped``) provides, or when
a root exists in no carried wheel. Imports of packages outside the carry and the standard
library are listed: the GPU image must hold them (scripts/gpu_image_packages.txt).

This reads sources, it imports nothing: a CUDA build of vLLM does not import on a CPU machine
with another torch. What it cannot see (``importlib.import_module`` with a computed name) is
what the traced roots cover: the modules the engine really loaded.
"""

from __future__ import annotations

import argparse
import ast
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Closure", "closure", "module_index", "top_names", "unguarded_imports"]


def _module_name(member: str) -> tuple[str, bool] | None:
    """``(module name, is a package)`` of a wheel member that is a module, else None."""
    parts = member.split("/")
    if any(p.endswith((".dist-info", ".data")) for p in parts[:1]):
        return None
    name = parts[-1]
    if name.endswith(".py"):
        stem = name[:-3]
        if stem == "__init__":
            return ".".join(parts[:-1]), True
        return ".".join([*parts[:-1], stem]), False
    if name.endswith(".so"):  # an extension: foo.abi3.so, foo.cpython-312-x86_64-linux-gnu.so
        return ".".join([*parts[:-1], name.split(".")[0]]), False
    return None


def module_index(wheels: list[Path]) -> dict[str, tuple[Path, str, bool]]:
    """Every module the wheels hold: name -> (wheel, member, is a package)."""
    index: dict[str, tuple[Path, str, bool]] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                found = _module_name(member)
                if found and found[0]:
                    index.setdefault(found[0], (wheel, member, found[1]))
    return index


def top_names(wheel: Path) -> set[str]:
    """The top-level import names a wheel provides."""
    return {name.split(".")[0] for name in module_index([wheel])}


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, target] if target else base)


#: An ``if`` whose test names one of these runs its imports only where the package is there
#: (vLLM's ``has_flashinfer()``, ``find_spec``, ``is_..._available()``) or never at run time.
GUARDS = ("TYPE_CHECKING", "has_", "find_spec", "_available", "is_installed")


def _guard(test: ast.expr) -> bool:
    text = ast.unparse(test)
    return any(word in text for word in GUARDS)


def unguarded_imports(
    source: str, module: str, is_package: bool
) -> list[tuple[str, list[str], bool]]:
    """The imports that run when ``module`` is imported: ``(module, names imported from it,
    optional)`` with relative imports made absolute; ``optional``: inside a ``try`` or under
    a ``GUARDS`` test, so it runs only where its package is there (module docstring)."""
    out: list[tuple[str, list[str], bool]] = []

    def visit(body: list[ast.stmt], optional: bool) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                out.extend((alias.name, [], optional) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = _absolute(module, is_package, node.level, node.module)
                out.append((target, [alias.name for alias in node.names], optional))
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body, optional or _guard(node.test))
                visit(node.orelse, optional)
            elif isinstance(node, ast.Try):
                visit(node.body, True)
                for handler in node.handlers:
                    visit(handler.body, optional)
                visit(node.orelse, True)
                visit(node.finalbody, optional)
            elif isinstance(node, (ast.With, ast.ClassDef)):
                visit(node.body, optional)
            # FunctionDef: runs later, if ever

    visit(ast.parse(source).body, False)
    return out


@dataclass
class Closure:
    """What ``closure`` found."""

    reached: set[str] = field(default_factory=set)
    missing_roots: list[str] = field(default_factory=list)  # required, not carried
    absent_roots: list[str] = field(default_factory=list)  # traced, not in this release
    dropped: dict[str, set[str]] = field(default_factory=dict)  # package -> importers
    outside: dict[str, set[str]] = field(default_factory=dict)  # package -> importers

    @property
    def ok(self) -> bool:
        """Nothing dropped is reached and every root is carried."""
        return not self.dropped and not self.missing_roots


def closure(
    kept: list[Path], dropped: list[Path], roots: list[str], required: tuple[str, ...] = ()
) -> Closure:
    """Follow ``roots`` and ``required`` through the sources of the ``kept`` wheels (module
    docstring). A root the wheels lack is skipped (``absent_roots``: traced on another vLLM
    release); a ``required`` one they lack fails the check (``missing_roots``)."""
    index = module_index(kept)
    carried = {name.split(".")[0] for name in index}
    gone = set().union(*(top_names(w) for w in dropped)) - carried if dropped else set()
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    result = Closure()
    # (module, optional): optional while every import chain to it has an optional link, so
    # its own imports run only where some guarded package is there
    todo: list[tuple[str, bool]] = []
    for root in roots:
        if root in index:
            todo.append((root, False))
        else:
            result.absent_roots.append(root)
    for root in required:
        if root in index:
            todo.append((root, False))
        else:
            result.missing_roots.append(root)
    optional_only: set[str] = set()
    sources: dict[Path, zipfile.ZipFile] = {}
    try:
        while todo:
            name, optional = todo.pop()
            if name in result.reached and (optional or name not in optional_only):
                continue  # seen already, at least as required as now
            result.reached.add(name)
            if optional:
                optional_only.add(name)
            else:
                optional_only.discard(name)
            # importing a.b.c imports a and a.b first
            parts = name.split(".")
            for i in range(1, len(parts)):
                if ".".join(parts[:i]) in index:
                    todo.append((".".join(parts[:i]), optional))
            wheel, member, is_package = index[name]
            if not member.endswith(".py"):
                continue
            zf = sources.setdefault(wheel, zipfile.ZipFile(wheel))
            source = zf.read(member).decode("utf-8", "replace")
            try:
                imports = unguarded_imports(source, name, is_package)
            except SyntaxError:
                continue
            for target, names, guarded in imports:
                guarded = guarded or optional
                top = target.split(".")[0]
                if top in stdlib or not top:
                    continue
                if guarded and top not in carried:  # runs only where the package is there
                    continue
                if top in gone:
                    result.dropped.setdefault(top, set()).add(name)
                    continue
                if top not in carried:
                    result.outside.setdefault(top, set()).add(name)
                    continue
                candidates = [target, *(f"{target}.{n}" for n in names)]
                todo.extend((c, guarded) for c in candidates if c in index)
    finally:
        for zf in sources.values():
            zf.close()
    return result


#: import name -> distribution name, where they differ, for the image's package list
IMPORT_TO_DIST = {"PIL": "pillow", "cpuinfo": "py-cpuinfo", "yaml": "pyyaml", "grpc": "grpcio",
                  "google": "protobuf", "dateutil": "python-dateutil", "sklearn": "scikit-learn",
                  "pynvml": "nvidia-ml-py", "cv2": "opencv-python-headless"}  # fmt: skip


def in_image(top: str, image_packages: set[str]) -> bool:
    """Whether import name ``top`` is a package of the GPU image (its normalised list)."""
    dist = IMPORT_TO_DIST.get(top, top)
    return dist.lower().replace("_", "-") in image_packages


def main(argv: list[str] | None = None) -> int:
    """CLI: exit 0 when the carry holds the closure, 1 when not, 2 on bad input."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel_dir", type=Path)
    parser.add_argument("roots_file", type=Path)
    parser.add_argument("--dropped", type=Path, help="the wheels left out of the carry")
    parser.add_argument("--root", action="append", default=[], help="one more root module")
    parser.add_argument("--image", type=Path, help="the GPU image's package list")
    args = parser.parse_args(argv)
    kept = sorted(args.wheel_dir.glob("*.whl"))
    if not kept:
        print(f"carry_closure: no wheels in {args.wheel_dir}", file=sys.stderr)
        return 2
    if not args.roots_file.is_file():
        print(f"carry_closure: {args.roots_file}: no such file", file=sys.stderr)
        return 2
    roots = [line.strip() for line in args.roots_file.read_text().splitlines() if line.strip()]
    dropped = sorted(args.dropped.glob("*.whl")) if args.dropped else []
    res = closure(kept, dropped, roots, tuple(args.root))
    print(
        f"{len(res.reached)} modules reached from {len(roots) + len(args.root)} roots "
        f"({len(res.absent_roots)} traced roots are not in this release)"
    )
    for root in res.missing_roots:
        print(f"root not carried: {root}")
    for top, who in sorted(res.dropped.items()):
        print(f"DROPPED but imported: {top} (by {', '.join(sorted(who)[:4])})")
    image = set()
    if args.image is not None:
        lines = args.image.read_text().splitlines()
        image = {line.split()[0].lower().replace("_", "-") for line in lines if line.strip()}
    for top, who in sorted(res.outside.items()):
        where = "in the image" if in_image(top, image) else "neither carried nor in the image"
        print(f"{where}: {top} (by {', '.join(sorted(who)[:3])})")
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
