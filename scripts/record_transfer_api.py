"""Record the weight-transfer API crossrl calls on the GPU and NPU lanes from the pinned
wheels themselves (CI has neither engine). Each engine module is read against the vLLM its lane
pins: vLLM's ``ipc`` / ``nccl`` against vLLM 0.24.0 (the GPU lane), vllm-ascend's ``npu_ipc`` /
``hccl`` against vLLM 0.26.0 (the NPU lane: vllm-ascend 0.26.0rc1's classes inherit 0.26's).

Per trainer module the HAL names (``DeviceBackend.weight_transfer_trainer`` and
``colocated_transfer_trainer``): its engine class, static methods, the fields of its init info,
update info and trainer arguments, the keys ``trainer_init`` reads, the names the wheel
registers the engine under, and its parse rule, behaviour rather than names: the source of
``parse_init_info`` / ``parse_update_info`` of every class from the engine up to vLLM's base,
the init- and update-info dataclasses from vLLM's base down (fields, defaults,
``__post_init__``) and the module constants their defaults read. Writes
``tests/fixtures/weight_transfer_api.json``; ``tests/test_transfer_payloads.py`` runs the
payload each crossrl push builds through each recorded rule.

    pip download --no-deps vllm==0.24.0 vllm-ascend==0.26.0rc1 -d /tmp/wheels
    pip download --no-deps vllm==0.26.0 -d /tmp/wheels/v26
    python scripts/record_transfer_api.py --gpu-vllm /tmp/wheels/vllm-0.24.0-*.whl \
        --npu-vllm /tmp/wheels/v26/vllm-0.26.0-*.whl \
        --ascend /tmp/wheels/vllm_ascend-0.26.0rc1-*.whl
"""

from __future__ import annotations

import ast
import json
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "weight_transfer_api.json"
#: trainer module -> (where the engine is registered: files of the wheel to read)
_VLLM_REGISTRY = ["vllm/distributed/weight_transfer/factory.py"]
_ASCEND_REGISTRY = [
    "vllm_ascend/distributed/weight_transfer/__init__.py",
    "vllm_ascend/patch/platform/patch_weight_transfer_engine.py",
]
#: trainer module -> (the lane whose wheels it is read in, where the engine is registered)
MODULES = {
    "vllm.distributed.weight_transfer.nccl_engine": ("gpu", _VLLM_REGISTRY),
    "vllm.distributed.weight_transfer.ipc_engine": ("gpu", _VLLM_REGISTRY),
    "vllm_ascend.distributed.weight_transfer.hccl_engine": ("npu", _ASCEND_REGISTRY),
    "vllm_ascend.distributed.weight_transfer.npu_ipc_engine": ("npu", _ASCEND_REGISTRY),
}
#: The methods of a parse rule, recorded from the engine class up to vLLM's base.
PARSE_METHODS = ("parse_init_info", "parse_update_info")


def _fields(cls: ast.ClassDef, known: dict[str, ast.ClassDef]) -> list[str]:
    """A dataclass's fields, its bases' first (a base found among ``known`` classes by name:
    vllm-ascend's NPU IPC classes inherit vLLM's)."""
    inherited = []
    for base in cls.bases:
        name = getattr(base, "id", None) or getattr(base, "attr", None)
        if name in known and known[name] is not cls:
            inherited += _fields(known[name], known)
    own = [
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id != "_"
    ]
    return inherited + [f for f in own if f not in inherited]


def _registered(tree: ast.Module, cls_name: str, module: str) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "register_engine":
            args = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if len(args) >= 2 and args[1] == module:
                names.append(args[0])
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
            key = node.targets[0].slice
            if isinstance(key, ast.Constant) and cls_name in ast.unparse(node.value):
                names.append(key.value)
    return names


def _read(wheel: str) -> tuple[str, dict[str, str]]:
    """``("<package> <version>", {path: text})`` of a wheel's weight-transfer sources."""
    package, version = Path(wheel).name.split("-")[:2]
    with zipfile.ZipFile(wheel) as zf:
        files = {
            name: zf.read(name).decode()
            for name in zf.namelist()
            if name.endswith(".py") and "weight_transfer" in name
        }
    return f"{package} {version}", files


def _base_names(cls: ast.ClassDef) -> list[str]:
    """The names of ``cls``'s bases (``Generic``-style subscripts by their class)."""
    names = []
    for base in cls.bases:
        base = base.value if isinstance(base, ast.Subscript) else base
        names.append(getattr(base, "id", None) or getattr(base, "attr", None))
    return names


def _chain(cls: ast.ClassDef, known: dict) -> list[ast.ClassDef]:
    """``cls`` and its bases found among ``known`` (by name), vLLM's base first."""
    out = []
    for name in _base_names(cls):
        if name in known and known[name][0] is not cls:
            out += [c for c in _chain(known[name][0], known) if c not in out]
    return out + [cls]


def _where(cls: ast.ClassDef, known: dict) -> str:
    return known[cls.name][1]


def _constants(sources: list[str], files: dict[str, str], defined: set[str]) -> dict[str, str]:
    """Module-level constant assignments (``NAME = <constant expression>``) of ``files`` that
    ``sources`` read and do not define themselves."""
    read = {
        n.id
        for text in sources
        for n in ast.walk(ast.parse(text))
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }
    found = {}
    for text in files.values():
        for node in ast.parse(text).body:
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
                continue
            name = getattr(node.targets[0], "id", None)
            constant = all(
                isinstance(n, ast.Constant | ast.BinOp | ast.operator | ast.expr_context)
                for n in ast.walk(node.value)
            )
            if name in read and name not in defined and constant:
                found[name] = ast.unparse(node)
    return dict(sorted(found.items()))


def _rule(engine: ast.ClassDef, info_classes: dict, known: dict, files: dict) -> dict:
    """The parse rule of ``engine``: each class of its chain that defines a parse method (its
    source and the info classes it names), and each info dataclass chain, base first."""
    engines = []
    for cls in _chain(engine, known):
        methods = {
            f.name: ast.unparse(f)
            for f in cls.body
            if isinstance(f, ast.FunctionDef) and f.name in PARSE_METHODS
        }
        attrs = {
            n.targets[0].id: n.value.id
            for n in cls.body
            if isinstance(n, ast.Assign)
            and isinstance(n.targets[0], ast.Name)
            and n.targets[0].id in ("init_info_cls", "update_info_cls")
            and isinstance(n.value, ast.Name)
        }
        if methods or attrs:
            engines.append(
                {"class": cls.name, "file": _where(cls, known), "methods": methods, **attrs}
            )
    dataclasses = []
    for cls in info_classes.values():
        for link in _chain(cls, known):
            entry = {"class": link.name, "file": _where(link, known), "source": ast.unparse(link)}
            if entry not in dataclasses:
                dataclasses.append(entry)
    sources = [m for e in engines for m in e["methods"].values()]
    sources += [d["source"] for d in dataclasses]
    defined = {d["class"] for d in dataclasses}
    return {
        "engines": engines,
        "dataclasses": dataclasses,
        "constants": _constants(sources, files, defined),
    }


def record(lanes: dict[str, list[str]]) -> dict:
    """The fixture (module docstring) of each module in ``MODULES``, read in the wheels of its
    lane: ``lanes["gpu"]`` (vLLM 0.24.0's wheel) and ``lanes["npu"]`` (vLLM 0.26.0's and
    vllm-ascend 0.26.0rc1's)."""
    out = {}
    for module, (lane, registries) in MODULES.items():
        read = [_read(wheel) for wheel in lanes[lane]]
        files = {path: text for _, wheel_files in read for path, text in wheel_files.items()}
        known = {}
        for label, wheel_files in read:
            for path, text in wheel_files.items():
                for n in ast.parse(text).body:
                    if isinstance(n, ast.ClassDef):
                        known.setdefault(n.name, (n, f"{label} {path}"))
        tree = ast.parse(files[module.replace(".", "/") + ".py"])
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        engine = next(
            c
            for c in classes.values()
            if any(
                isinstance(f, ast.FunctionDef) and f.name == "trainer_send_weights" for f in c.body
            )
        )
        statics = [
            f.name
            for f in engine.body
            if isinstance(f, ast.FunctionDef)
            and any(getattr(d, "id", "") == "staticmethod" for d in f.decorator_list)
        ]
        init = next((f for f in engine.body if getattr(f, "name", "") == "trainer_init"), None)
        keys = sorted(
            {
                n.slice.value
                for n in ast.walk(init or ast.Module(body=[], type_ignores=[]))
                if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant)
            }
        )

        def pick(suffix: str, classes=classes) -> ast.ClassDef:
            return next(c for n, c in classes.items() if n.endswith(suffix))

        fields_of = {name: n for name, (n, _) in known.items()}
        registered = []
        for path in registries:
            registered += _registered(ast.parse(files[path]), engine.name, module)
        info = {"init_info": pick("InitInfo"), "update_info": pick("UpdateInfo")}
        out[module] = {
            "read_in": [label for label, _ in read],
            "class": engine.name,
            "static_methods": statics,
            "init_info": _fields(info["init_info"], fields_of),
            "update_info": _fields(info["update_info"], fields_of),
            "trainer_args": _fields(pick("TrainerSendWeightsArgs"), fields_of),
            "trainer_init_keys": keys,
            "registered_as": sorted(set(registered)),
            "rule": _rule(engine, info, known, files),
        }
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-vllm", required=True, help="vLLM 0.24.0's wheel (the GPU pin)")
    parser.add_argument("--npu-vllm", required=True, help="vLLM 0.26.0's wheel (the NPU pin)")
    parser.add_argument("--ascend", required=True, help="vllm-ascend 0.26.0rc1's wheel")
    args = parser.parse_args()
    lanes = {"gpu": [args.gpu_vllm], "npu": [args.npu_vllm, args.ascend]}
    OUT.write_text(json.dumps(record(lanes), indent=2, sort_keys=True) + "\n")
    print(f"wrote {OUT}")
