"""Record the packed broadcast producers the weight push runs on accelerators, from the pinned
wheels themselves (CI has neither engine): the source of vLLM 0.24.0's
``packed_nccl_broadcast_producer`` (with the ``pack_tensors`` and ``PackedChunk`` it uses) and
of vllm-ascend 0.26.0rc1's ``packed_broadcast_producer``, both in the wheel's
``distributed/weight_transfer/packed_tensor.py``. Writes ``tests/fixtures/packed_producers.json``,
which ``tests/test_push_streams.py`` runs on a model of device streams and the caching
allocator, with what ``hal.push_staging`` hands them.

    pip download --no-deps vllm==0.24.0 vllm-ascend==0.26.0rc1 -d /tmp/wheels
    python scripts/record_packed_producers.py /tmp/wheels/vllm-0.24.0-*.whl \
        /tmp/wheels/vllm_ascend-0.26.0rc1-*.whl
"""

from __future__ import annotations

import ast
import json
import sys
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "packed_producers.json"
#: what to record: name -> (the wheel's file, its definitions to keep, the producer's name,
#: the ``torch`` attribute its streams come from)
PRODUCERS = {
    "vllm 0.24.0 nccl": (
        "vllm/distributed/weight_transfer/packed_tensor.py",
        ["PackedChunk", "pack_tensors", "packed_nccl_broadcast_producer"],
        "packed_nccl_broadcast_producer",
        "cuda",
    ),
    "vllm-ascend 0.26.0rc1 hccl": (
        "vllm_ascend/distributed/weight_transfer/packed_tensor.py",
        ["packed_broadcast_producer"],
        "packed_broadcast_producer",
        "npu",
    ),
}


def record(wheels: list[str]) -> dict:
    """The producers' sources, read in ``wheels`` (the wheel holding each file)."""
    files: dict[str, tuple[str, str]] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.endswith("weight_transfer/packed_tensor.py"):
                    files[name] = (Path(wheel).name, zf.read(name).decode())
    out = {}
    for key, (path, keep, producer, device) in PRODUCERS.items():
        wheel, text = files[path]
        tree = ast.parse(text)
        nodes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef)}
        out[key] = {
            "wheel": wheel,
            "file": path,
            "producer": producer,
            "device": device,
            "source": "\n\n".join(ast.unparse(nodes[n]) for n in keep),
        }
    return out


if __name__ == "__main__":
    OUT.write_text(json.dumps(record(sys.argv[1:]), indent=2, sort_keys=True) + "\n")
    print(f"wrote {OUT}")
