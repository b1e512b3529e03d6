"""Record the fused-kernel calling conventions crossrl's kernel set uses (``hal.kernels``) from
the pinned wheels themselves (CI has neither a GPU nor an NPU): Liger-Kernel's autograd
functions' ``forward`` arguments, and torch_npu's op schemas (from the strings of its
library). Writes ``tests/fixtures/kernel_api.json``, which ``tests/test_kernels.py`` checks
crossrl's calls against.

    pip download --no-deps liger-kernel==0.8.5 torch-npu==2.10.0.post4 -d /tmp/wheels
    python scripts/record_kernel_api.py /tmp/wheels/liger_kernel-0.8.5-*.whl \
        /tmp/wheels/torch_npu-2.10.0.post4-*.whl
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "kernel_api.json"
#: (module file in the Liger wheel, class) whose ``forward`` crossrl calls through ``apply``.
LIGER = [
    ("liger_kernel/ops/rms_norm.py", "LigerRMSNormFunction"),
    ("liger_kernel/ops/swiglu.py", "LigerSiLUMulFunction"),
    ("liger_kernel/ops/rope.py", "LigerRopeFunction"),
]
#: torch_npu ops whose schema crossrl relies on; ``_fused_adamw_``: whether the NPU has it.
NPU_OPS = (
    "npu_rms_norm",
    "npu_swiglu",
    "npu_rotary_mul",
    "npu_grouped_matmul",
    "npu_moe_token_permute",
    "npu_moe_token_unpermute",
)


def _forward_args(source: str, cls_name: str) -> list[str]:
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    forward = next(f for f in cls.body if getattr(f, "name", "") == "forward")
    return [a.arg for a in forward.args.args]


def record(liger_wheel: str, npu_wheel: str) -> dict:
    out: dict = {}
    with zipfile.ZipFile(liger_wheel) as zf:
        for path, cls in LIGER:
            module = path.removesuffix(".py").replace("/", ".")
            out[f"{module}.{cls}.forward"] = _forward_args(zf.read(path).decode(), cls)
    with zipfile.ZipFile(npu_wheel) as zf:
        library = zf.read("torch_npu/lib/libtorch_npu.so")
    strings = set(re.findall(rb"[\x20-\x7e]{12,}", library))
    for op in NPU_OPS:
        schemas = sorted(s.decode() for s in strings if s.startswith(f"{op}(".encode()))
        out[f"torch_npu.{op}"] = schemas[0] if schemas else None
    out["torch_npu._fused_adamw_"] = any(b"wrapper_NPU___fused_adamw_" in s for s in strings)
    return out


if __name__ == "__main__":
    OUT.write_text(json.dumps(record(sys.argv[1], sys.argv[2]), indent=2, sort_keys=True) + "\n")
    print(f"wrote {OUT}")
