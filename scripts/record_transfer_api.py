"""Record the weight-transfer names crossrl calls on the GPU and NPU lanes from the pinned
wheels themselves (CI has neither engine): for each trainer module the HAL names
(``DeviceBackend.weight_transfer_trainer`` and ``colocated_transfer_trainer``), its engine class, static methods, the fields of
its init info, update info and trainer arguments, the keys ``trainer_init`` reads, and the
names the wheel registers the engine under. Writes ``tests/fixtures/weight_transfer_api.json``,
which ``tests/test_weight_transfer.py`` checks crossrl's calls against.

    pip download --no-deps vllm==0.24.0 vllm-ascend==0.26.0rc1 -d /tmp/wheels
    python scripts/record_transfer_api.py /tmp/wheels/vllm-0.24.0-*.whl \
        /tmp/wheels/vllm_ascend-0.26.0rc1-*.whl
"""

from __future__ import annotations

import ast
import json
import sys
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "weight_transfer_api.json"
#: trainer module -> (where the engine is registered: files of the wheel to read)
_VLLM_REGISTRY = ["vllm/distributed/weight_transfer/factory.py"]
_ASCEND_REGISTRY = [
    "vllm_ascend/distributed/weight_transfer/__init__.py",
    "vllm_ascend/patch/platform/patch_weight_transfer_engine.py",
]
MODULES = {
    "vllm.distributed.weight_transfer.nccl_engine": _VLLM_REGISTRY,
    "vllm.distributed.weight_transfer.ipc_engine": _VLLM_REGISTRY,
    "vllm_ascend.distributed.weight_transfer.hccl_engine": _ASCEND_REGISTRY,
    "vllm_ascend.distributed.weight_transfer.npu_ipc_engine": _ASCEND_REGISTRY,
}


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


def record(wheels: list[str]) -> dict:
    files = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.endswith(".py") and "weight_transfer" in name:
                    files[name] = zf.read(name).decode()
    known = {
        n.name: n
        for text in files.values()
        for n in ast.parse(text).body
        if isinstance(n, ast.ClassDef)
    }
    out = {}
    for module, registries in MODULES.items():
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

        registered = []
        for path in registries:
            registered += _registered(ast.parse(files[path]), engine.name, module)
        out[module] = {
            "class": engine.name,
            "static_methods": statics,
            "init_info": _fields(pick("InitInfo"), known),
            "update_info": _fields(pick("UpdateInfo"), known),
            "trainer_args": _fields(pick("TrainerSendWeightsArgs"), known),
            "trainer_init_keys": keys,
            "registered_as": sorted(set(registered)),
        }
    return out


if __name__ == "__main__":
    OUT.write_text(json.dumps(record(sys.argv[1:]), indent=2, sort_keys=True) + "\n")
    print(f"wrote {OUT}")
