"""The npu backend: Huawei Ascend through torch_npu, HCCL and `npu_fusion_attention`.

torch_npu is imported only here, lazily, and only after `importlib.util.find_spec` says it is
installed: a torch_npu without CANN breaks `import torch` itself, so nothing else may touch it.
The argument builders below are plain functions so they can be checked on any machine.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os

import torch

from hal import RAY_RESOURCES
from hal.base import DeviceBackend
from hal.kernels import TORCH_NPU
from hal.npu_versions import (
    INSTALL_HINT,
    PINNED_VLLM_ASCEND,
    VllmAscendVersionError,
    installed_version,
    uses_layerwise_reload,
    vllm_ascend_engine_options,
)

NPU_CAUSAL_MASK_SIZE = 2048
"""Side of the compressed causal mask `npu_fusion_attention` takes with sparse_mode=3."""
NPU_MAX_SEGMENTS_PER_CALL = 1024
"""torch_npu documents at most 1K entries in `actual_seq_qlen` for TND; longer rows are split."""
NPU_SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3

HCCL_PORT_RANGE_BASES = {"HCCL_HOST_SOCKET_PORT_RANGE": 61000, "HCCL_NPU_SOCKET_PORT_RANGE": 62000}
"""First port of slot 0's range per variable. CANN 9 (HCCL environment variables) reads
``start-end`` (also ``auto`` and comma lists); unset, each process takes the one default port
(16666 on the NPU side), and several HCCL processes on one NPU must each set a range of
their own, on every card of the communicator, or may fail on port conflicts. 61000 on lies
above Linux's default ephemeral ports (32768-60999) and below 65536 for every slot."""
HCCL_PORTS_PER_SLOT = 64
"""Ports per process kind: at least the processes of a kind on one host (16 dies on an A3
node; CANN asks for no fewer than the HCCL processes per NPU)."""
HCCL_PORT_SLOTS = 8
"""Process kinds a job may start on one die (training roles, then the engine)."""


def hccl_port_ranges(slot: int) -> dict[str, str]:
    """``HCCL_HOST_SOCKET_PORT_RANGE`` and ``HCCL_NPU_SOCKET_PORT_RANGE`` for process kind
    ``slot``: ``HCCL_PORTS_PER_SLOT`` ports each, disjoint from every other slot's."""
    if not 0 <= slot < HCCL_PORT_SLOTS:
        raise ValueError(
            f"HCCL port slot {slot}: a job has at most {HCCL_PORT_SLOTS} process kinds per "
            f"device, slots 0..{HCCL_PORT_SLOTS - 1}"
        )
    first = {key: base + slot * HCCL_PORTS_PER_SLOT for key, base in HCCL_PORT_RANGE_BASES.items()}
    return {key: f"{start}-{start + HCCL_PORTS_PER_SLOT - 1}" for key, start in first.items()}


HCCL_OP_WAIT_OFFSET_S = 30
"""torch_npu 2.10.0.post4 (``ProcessGroupHCCL``): with ``HCCL_EVENT_TIMEOUT`` unset, a
stream waits for an HCCL operator's event ``HCCL_EXEC_TIMEOUT`` + 30 s before it fails."""
HCCL_EXEC_MARGIN_S = 2 * HCCL_OP_WAIT_OFFSET_S
"""Seconds ``HCCL_EXEC_TIMEOUT`` stays under the process group's timeout: HCCL's operator
timeout, the event wait 30 s after it and the watchdog's look at the failed work all come
before the group's own timeout, so HCCL records the operator that failed in its plog."""
HCCL_CONNECT_TIMEOUT_S = (120, 7200)
"""The range CANN accepts for ``HCCL_CONNECT_TIMEOUT`` (seconds to build a communicator's
links; CANN's default is the lower end)."""

#: HCCL results that mean a collective broke rather than was misused (``hccl_types.h``):
#: TIMEOUT 9, TCP_CONNECT 11, ROCE_CONNECT 12, TCP_TRANSFER 13, ROCE_TRANSFER 14, NETWORK 19,
#: REMOTE 21, SUSPENDING 22, OPRETRY_FAIL 23.
HCCL_BROKEN_RESULTS = (9, 11, 12, 13, 14, 19, 21, 22, 23)


def hccl_timeout_env(timeout_s: float) -> dict[str, str]:
    """The HCCL and torch_npu settings for process groups of ``timeout_s`` seconds
    (``run.collective_timeout_s``). torch_npu 2.10.0.post4 wants ``HCCL_EXEC_TIMEOUT``
    below the group's timeout: at or above it, every ``ProcessGroupHCCL`` warns "The watchdog
    timeout ...ms (which is set by init_process_group) is less than or equal to HCCL
    execution timeout ...ms! The plog may not be recorded." So:

    - ``HCCL_EXEC_TIMEOUT``: ``HCCL_EXEC_MARGIN_S`` under the group's timeout (half of it
      for a timeout under 2 minutes), whole seconds, at least 1;
    - ``HCCL_CONNECT_TIMEOUT``: the same, within CANN's range (``HCCL_CONNECT_TIMEOUT_S``):
      a peer late to build the links gets the patience of one late to a collective;
    - ``HCCL_ASYNC_ERROR_HANDLING=1``: the watchdog tears the process down on a failed
      collective (a dead process, which a restart replaces);
    - ``TORCH_HCCL_ENABLE_MONITORING=1``, ``TORCH_HCCL_HEARTBEAT_TIMEOUT_SEC``: the group's
      timeout: torch_npu's heartbeat monitor (off by default) ends a process whose watchdog
      itself is stuck (an HCCL call that never returns), which no timeout above catches.
    """
    margin = min(HCCL_EXEC_MARGIN_S, timeout_s / 2)
    exec_s = min(max(int(math.floor(timeout_s - margin)), 1), 2**31 - 1)
    low, high = HCCL_CONNECT_TIMEOUT_S
    return {
        "HCCL_EXEC_TIMEOUT": str(exec_s),
        "HCCL_CONNECT_TIMEOUT": str(min(max(exec_s, low), high)),
        "HCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_HCCL_ENABLE_MONITORING": "1",
        "TORCH_HCCL_HEARTBEAT_TIMEOUT_SEC": str(max(int(math.ceil(timeout_s)), 1)),
    }


def torch_npu_installed() -> bool:
    """True when the torch_npu package is importable (checked without importing it)."""
    return importlib.util.find_spec("torch_npu") is not None


def import_torch_npu():
    """Import torch_npu (registers the `npu` device with torch); raises ImportError when absent."""
    return importlib.import_module("torch_npu")


def npu_causal_mask(device: torch.device | str | None = None) -> torch.Tensor:
    """The compressed causal mask for sparse_mode=3: a [2048, 2048] bool, True above the diagonal.

    True means "masked out" for torch_npu, the opposite of SDPA's boolean masks.
    """
    size = NPU_CAUSAL_MASK_SIZE
    return torch.ones(size, size, dtype=torch.bool, device=device).triu(diagonal=1)


def npu_fusion_attention_args(
    cu_seqlens: torch.Tensor | list[int],
    num_heads: int,
    scale: float,
    *,
    dropout: float = 0.0,
    atten_mask: torch.Tensor | None = None,
    kv_seqlens: list[int] | None = None,
) -> dict:
    """Keyword arguments for `torch_npu.npu_fusion_attention(q, k, v, **kwargs)`, causal TND.

    cu_seqlens: [R+1] token offsets starting at 0 (R <= NPU_MAX_SEGMENTS_PER_CALL); num_heads:
    query heads (key/value heads are read from k's shape, GQA allowed); scale: softmax scale.
    torch_npu wants the cumulative *end* offsets as python ints (no leading 0) for both q and kv,
    and causality as sparse_mode=3 (right-down causal) with the compressed 2048x2048 mask.
    atten_mask: that mask already on the device; built on the CPU when not given.
    kv_seqlens: the keys' own [R+1] offsets when they differ from the queries' (shared
    prompts, ``hal.shared_prefix``): right-down causal aligns each segment's queries with the
    last of its keys.
    """
    offsets = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if not offsets or offsets[0] != 0:
        raise ValueError(f"cu_seqlens={offsets[:8]}... must start at 0; prepend 0 to the offsets")
    ends = [int(x) for x in offsets[1:]]
    if len(ends) > NPU_MAX_SEGMENTS_PER_CALL:
        raise ValueError(
            f"cu_seqlens holds {len(ends)} segments; npu_fusion_attention takes at most "
            f"{NPU_MAX_SEGMENTS_PER_CALL} per call: split the row (NpuBackend.varlen_attention does)"
        )
    kv_ends = ends
    if kv_seqlens is not None:
        if len(kv_seqlens) != len(offsets) or kv_seqlens[0] != 0:
            raise ValueError(
                f"kv_seqlens has {len(kv_seqlens)} offsets starting at {kv_seqlens[:1]}; want "
                f"{len(offsets)} starting at 0, one per query offset"
            )
        kv_ends = [int(x) for x in kv_seqlens[1:]]
    return {
        "head_num": int(num_heads),
        "input_layout": "TND",
        "atten_mask": npu_causal_mask() if atten_mask is None else atten_mask,
        "scale": float(scale),
        "keep_prob": 1.0 - float(dropout),
        "actual_seq_qlen": ends,
        "actual_seq_kvlen": kv_ends,
        "sparse_mode": NPU_SPARSE_MODE_RIGHT_DOWN_CAUSAL,
    }


def split_segments(offsets: list[int], max_segments: int) -> list[tuple[int, int, list[int]]]:
    """Split packed-row offsets into chunks of at most `max_segments` segments.

    Returns (first_token, end_token, offsets rebased to start at 0) per chunk, in order.
    """
    chunks = []
    for i in range(0, max(len(offsets) - 1, 0), max_segments):
        part = offsets[i : i + max_segments + 1]
        chunks.append((part[0], part[-1], [x - part[0] for x in part]))
    return chunks


def split_shared_segments(
    offsets: list[int], kv_offsets: list[int], max_segments: int
) -> list[tuple[int, int, int, int, list[int], list[int]]]:
    """``split_segments`` for separate query and key offsets (shared prompts): per chunk of at
    most ``max_segments`` segments, its query tokens ``[q0, q1)``, its key tokens ``[k0, k1)``
    and both offsets rebased to 0."""
    chunks = []
    for i in range(0, max(len(offsets) - 1, 0), max_segments):
        q, k = offsets[i : i + max_segments + 1], kv_offsets[i : i + max_segments + 1]
        chunks.append((q[0], q[-1], k[0], k[-1], [x - q[0] for x in q], [x - k[0] for x in k]))
    return chunks


class NpuBackend(DeviceBackend):
    """Ascend NPUs through torch.npu (after `import torch_npu`) and HCCL."""

    name = "npu"
    device_type = "npu"
    process_group_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    ray_resource = RAY_RESOURCES["npu"]
    ray_noset_env_var = "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"
    # HCCL's errors reach Python as plain RuntimeErrors from torch_npu: its HCCL_CHECK_ERROR
    # ("HCCL function error: <call>, error code is <n>"), its watchdog's async-error check,
    # its timeout; CANN's EI0002 (a notify wait timed out: a peer never came) and EI0006 (a
    # link was not built in time).
    collective_error_patterns = (
        rf"HCCL function error: .*error code is ({'|'.join(map(str, HCCL_BROKEN_RESULTS))})\b",
        r"HCCL_E_(TIMEOUT|TCP_CONNECT|ROCE_CONNECT|TCP_TRANSFER|ROCE_TRANSFER|NETWORK|REMOTE)",
        r"got ERROR via HcclGetCommAsyncError",
        r"Watchdog caught collective operation timeout",
        r"\bEI000[26]\b",
    )
    # torch_npu 2.10.0.post4's allocator raises c10::OutOfMemoryError (torch.OutOfMemoryError,
    # "NPU out of memory. Tried to allocate ..."); an op's workspace inside CANN comes back as
    # a RuntimeError with that text or CANN's EL0004 ("Failed to allocate memory")
    out_of_memory_patterns = (r"NPU out of memory", r"\bEL0004\b")
    # vllm-ascend 0.26.0rc1's batch_invariant.py: AscendC ops, else triton-ascend's kernels
    vllm_batch_invariant = True
    # torch_npu's npu_rms_norm, npu_swiglu and npu_rotary_mul, its fused AdamW, crossrl's
    # fused head (hal.kernels); MindSpeed
    # calls the same ops (docs/hal.md, "The kernel set")
    kernel_providers = TORCH_NPU
    # vllm-ascend 0.26.0rc1's own engine (vllm_ascend/distributed/weight_transfer/
    # hccl_engine.py, registered as "hccl" by its general plugin): PyHccl over a
    # StatelessProcessGroup, one communicator per process (2 x HCCL_BUFFSIZE in the budget).
    weight_transfer_engine = "hccl"
    weight_transfer_trainer = (
        "vllm_ascend.distributed.weight_transfer.hccl_engine",
        "HCCLWeightTransferEngine",
    )
    # ... and its engine for a colocated trainer (npu_ipc_engine.py, registered as "npu_ipc"):
    # NPU IPC handles (torch_npu's reductions) keyed by host IP and physical chip.
    colocated_transfer_engine = "npu_ipc"
    colocated_transfer_trainer = (
        "vllm_ascend.distributed.weight_transfer.npu_ipc_engine",
        "NPUIPCWeightTransferEngine",
    )

    def __init__(self) -> None:
        self._masks: dict[torch.device, torch.Tensor] = {}

    def device_module(self):
        import_torch_npu()  # registers torch.npu; a no-op after the first call
        return super().device_module()

    def device(self, local_rank: int = 0) -> torch.device:
        import_torch_npu()  # torch learns the "npu" device type from torch_npu
        return super().device(local_rank)

    def shared_buffer(self, nbytes: int, local_index: int = 0):
        """As on CUDA; torch_npu registers the IPC reductions of NPU tensors on import."""
        import_torch_npu()
        return super().shared_buffer(nbytes, local_index)

    def engine_env(self, device_ids: list[str]) -> dict[str, str]:
        """Plus what vllm-ascend needs to sleep and reload weights in place: no NZ (fractal)
        weight format, which its reload path cannot rebuild from HF-layout tensors."""
        return {**super().engine_env(device_ids), "VLLM_ASCEND_ENABLE_NZ": "0"}

    def process_port_env(self, slot: int, environ=None) -> dict[str, str]:
        """HCCL's host and NPU port ranges of process kind ``slot`` (``hccl_port_ranges``):
        the trainer's ranks and the engine share each die and both build HCCL communicators.
        A range already exported (``environ``, this process's environment by default) wins:
        that variable is left out, so the user's value reaches the process instead."""
        environ = os.environ if environ is None else environ
        return {k: v for k, v in hccl_port_ranges(slot).items() if k not in environ}

    def collective_timeout_env(self, timeout_s: float, environ=None) -> dict[str, str]:
        """HCCL's own timeouts just under the process group's (``hccl_timeout_env``), the
        watchdog that tears a process down on a failed collective and its heartbeat monitor.
        A value already exported is left to the user (the doctor checks it: under
        ``HCCL_OP_EXPANSION_MODE=AIV`` HCCL clamps ``HCCL_EXEC_TIMEOUT`` to 1091 s)."""
        environ = os.environ if environ is None else environ
        return {k: v for k, v in hccl_timeout_env(timeout_s).items() if k not in environ}

    @property
    def vllm_layerwise_reload(self) -> bool:
        """vLLM's layerwise reload from vllm-ascend 0.26.0rc1 on, as its own RL path does (its
        fused-MoE layers transpose their weights after loading: a straight ``load_weights``
        would corrupt them); ``load_weights`` before (``hal.npu_versions``)."""
        return uses_layerwise_reload(installed_version("vllm-ascend"))

    def vllm_engine_options(self) -> dict:
        """vllm-ascend's options for a colocated RL engine, spelled for the installed release
        (``hal.npu_versions``): extra sleep cleanup, which also releases the HCCL process
        groups' buffers and the ACL graph workspace while the trainer runs (its sleep otherwise
        frees only its own allocator's memory), and ND weights (no FRACTAL_NZ layout, which a
        reload cannot rebuild). Raises VllmAscendVersionError naming the fix when vllm-ascend
        is absent or too old to have the option."""
        version = installed_version("vllm-ascend")
        if version is None:
            raise VllmAscendVersionError(
                "rollout.engine=vllm on npu needs vllm-ascend, which is not installed: install "
                f"vllm-ascend {PINNED_VLLM_ASCEND} ({INSTALL_HINT}) or set rollout.engine=hf"
            )
        return vllm_ascend_engine_options(version)

    def check_engine_build(self) -> None:
        """Raise ``hal.npu_checks.EngineBuildMismatchError`` (one line: both chip types and the
        build command) when the installed vllm-ascend was built for another chip, before vLLM
        starts: its worker would assert in every replica (an A2 wheel on an A3 node)."""
        from hal.npu_checks import require_engine_build

        require_engine_build(lambda: import_torch_npu().npu.get_soc_version())

    def device_names(self) -> list[str]:
        """Chip name of every visible NPU (e.g. Ascend910B3)."""
        mod = self.device_module()
        return [mod.get_device_name(i) for i in range(mod.device_count())]

    def init_process_group(self, *args, **kwargs) -> bool:
        import_torch_npu()  # the hccl backend is registered by torch_npu
        return super().init_process_group(*args, **kwargs)

    def deterministic_env(self) -> dict[str, str]:
        """CANN's switches for reproducible collectives and matmuls (verl/vllm-ascend use these).

        HCCL/LCCL: deterministic reductions; CLOSE_MATMUL_K_SHIFT and ATB_MATMUL_SHUFFLE_K_ENABLE:
        fixed K-axis accumulation order in matmuls; ATB_LLM_LCOC_ENABLE: no fused comm+compute.
        `torch.use_deterministic_algorithms(True)` turns on ACL's deterministic operators.
        """
        return {
            "HCCL_DETERMINISTIC": "true",
            "LCCL_DETERMINISTIC": "1",
            "CLOSE_MATMUL_K_SHIFT": "1",
            "ATB_MATMUL_SHUFFLE_K_ENABLE": "0",
            "ATB_LLM_LCOC_ENABLE": "0",
        }

    @property
    def attention_impl_name(self) -> str:
        return "npu_fusion_attention TND (sparse_mode=3)"

    def _causal_mask(self, device: torch.device) -> torch.Tensor:
        if device not in self._masks:  # 4 MiB per device; build it once
            self._masks[device] = npu_causal_mask(device)
        return self._masks[device]

    def varlen_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        max_seqlen: int,
        scale: float,
        dropout: float = 0.0,
        cu_seqlens_host: list[int] | None = None,
    ) -> torch.Tensor:
        """`torch_npu.npu_fusion_attention` in TND layout, split every 1024 segments."""
        torch_npu = import_torch_npu()
        # The attention interface hands over [T, H, D] views of [1, H, T, D] tensors; the fused
        # kernel documents TND as a dense layout (transformers' and verl's NPU paths pass
        # contiguous tensors), and a row slice of a contiguous tensor stays contiguous.
        q, k, v = (x.contiguous() for x in (q, k, v))
        offsets = cu_seqlens_host if cu_seqlens_host is not None else cu_seqlens.tolist()
        mask = self._causal_mask(q.device)
        outputs = []
        for start, end, local in split_segments(offsets, NPU_MAX_SEGMENTS_PER_CALL):
            kwargs = npu_fusion_attention_args(
                local, q.shape[1], scale, dropout=dropout, atten_mask=mask
            )
            out = torch_npu.npu_fusion_attention(q[start:end], k[start:end], v[start:end], **kwargs)
            outputs.append(out[0])
        if not outputs:  # an empty row
            return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    def shared_prompt_kernel(
        self, dtype: torch.dtype, deterministic: bool | None = None
    ) -> str | None:
        """``npu_fusion_attention`` with separate query and key lengths, in every dtype it
        runs packed rows in."""
        return "npu_fusion_attention TND (actual_seq_kvlen, sparse_mode=3)"

    def shared_prefix_attention(self, q, k, v, offsets, parents, *, scale, dropout=0.0):
        """The shared layout on ``npu_fusion_attention``: each segment's keys gathered (its
        root's, then its own; ``hal.shared_prefix``), query and key lengths given apart,
        right-down causal; split every 1024 segments."""
        from hal.shared_prefix import LAST_LAYOUT

        torch_npu = import_torch_npu()
        layout, index, _, _ = LAST_LAYOUT.get(offsets, parents, q.device)
        q = q.contiguous()
        keys, values = (x.index_select(0, index).contiguous() for x in (k, v))
        mask = self._causal_mask(q.device)
        outputs = []
        for q0, q1, k0, k1, local_q, local_k in split_shared_segments(
            offsets, layout.cu_k, NPU_MAX_SEGMENTS_PER_CALL
        ):
            kwargs = npu_fusion_attention_args(
                local_q, q.shape[1], scale, dropout=dropout, atten_mask=mask, kv_seqlens=local_k
            )
            out = torch_npu.npu_fusion_attention(q[q0:q1], keys[k0:k1], values[k0:k1], **kwargs)
            outputs.append(out[0])
        if not outputs:
            return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
