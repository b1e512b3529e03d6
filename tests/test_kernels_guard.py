"""What the kernel set (``hal.kernels``) does when a fused kernel raises out of device memory,
and which kernels go into compiled blocks (``train.compile_blocks``; the config's refusal of
compilation beside checkpointing chosen by ``auto`` is in ``tests/test_auto_sizes.py``). The stand-ins and the
model helpers are ``tests/test_kernels.py``'s."""

from __future__ import annotations

import warnings

import pytest
import torch

from hal.kernels import LIGER, REFERENCE, TORCH_NPU, choose_kernels
from hal.registry import is_out_of_memory
from tests.test_kernels import _here, _run, _tiny, stand_ins  # noqa: F401 - the fixture

#: How each runtime words running out of memory: torch's and torch_npu's allocators raise
#: torch.OutOfMemoryError; a CANN op's workspace comes back as a RuntimeError with EL0004
#: (torch_npu 2.10.0.post4's libtorch_npu.so: "NPU out of memory. Tried to allocate ").
OUT_OF_MEMORY = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("NPU out of memory. Tried to allocate 1.50 GiB (NPU 0; 60.00 GiB total)"),
    RuntimeError("aclnnSwiGlu failed. EL0004: [PID: 77] Failed to allocate memory."),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
]


@pytest.mark.usefixtures("stand_ins")
@pytest.mark.parametrize("err", OUT_OF_MEMORY, ids=lambda e: str(e).split()[0])
@pytest.mark.parametrize("op", ["swiglu", "lm_head"])
def test_out_of_memory_in_a_fused_kernel_is_raised_not_a_fall_back(op, err):
    """A fused op that runs out of device memory raises that error: the op keeps its kernel
    (a transient OOM does not downgrade it for the whole run), no warning is said, and the
    larger reference is not tried at once."""
    assert is_out_of_memory(err)

    def out_of_memory(*args, **kwargs):
        raise err

    kernels = choose_kernels(_here(LIGER))
    kernels.calls[op] = out_of_memory
    fused = _tiny()
    kernels.apply(fused)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(type(err)) as raised:
        warnings.simplefilter("always")
        _run(fused)
    assert raised.value is err
    assert kernels.chosen[op] == LIGER[op].name and op not in kernels.reasons
    assert [w for w in caught if issubclass(w.category, RuntimeWarning)] == []


def test_other_errors_are_not_out_of_memory():
    assert not is_out_of_memory(RuntimeError("triton: no kernel for this GPU"))
    assert not is_out_of_memory(RuntimeError("HCCL function error: x, error code is 7"))
    assert not is_out_of_memory(ValueError("chunk_tokens=0 must be >= 1"))


@pytest.mark.usefixtures("stand_ins")
@pytest.mark.parametrize("providers", [LIGER, TORCH_NPU], ids=["liger", "torch_npu"])
def test_compiled_blocks_take_the_eager_ops_inside_a_layer(providers):
    """``train.compile_blocks``: inductor fuses the eager RMSNorm, SwiGLU and rope of each
    layer; no Liger or torch_npu autograd function goes inside a compiled region. The head
    and the optimizer, outside the layers, keep their kernels."""
    kernels = choose_kernels(_here(providers), compile_blocks=True)
    assert kernels.chosen == {
        "rms_norm": REFERENCE,
        "swiglu": REFERENCE,
        "rope": REFERENCE,
        "moe_experts": REFERENCE,
        "lm_head": providers["lm_head"].name,
        "optimizer": providers["optimizer"].name,
        "compile": "torch.compile",
    }
    assert kernels.reasons["swiglu"] == "train.compile_blocks: inductor fuses it"
    patched = kernels.apply(_tiny())
    assert patched == {"rms_norm": 0, "swiglu": 0, "rope": 0, "moe_experts": 0, "lm_head": 1}
    # without compilation the layer's ops keep their kernels
    assert choose_kernels(_here(providers)).chosen["swiglu"] == providers["swiglu"].name
