"""The training kernels of one device type (``train.kernels``): which implementation each op of
the update runs, and the per-model-instance patch that puts it in place.

Ops (``OPS``):

- ``rms_norm``: the decoder's RMSNorms (Llama's formula: fp32 normalisation, cast back, times
  the weight; the HF classes in ``RMS_NORM_CLASSES``);
- ``swiglu``: the gated MLP's ``silu(gate(x)) * up(x)`` (modules with ``gate_proj`` /
  ``up_proj`` / ``down_proj`` and a SiLU);
- ``rope``: the rotation of queries and keys in each attention module (``_patch_rope``);
- ``moe_experts``: a mixture-of-experts layer's experts (transformers' fused experts modules,
  ``hal.moe_experts``): the reference is the module's own forward (transformers' dispatch);
  CUDA takes torch's grouped GEMM (``F.grouped_mm``, bf16 only: other dtypes run the
  reference), the NPU torch_npu's ``npu_grouped_matmul`` inside an autograd function of
  ours (it has none), with its ``npu_swiglu`` and, in bf16, its token permute and unpermute.
  The tests hold both, and transformers' eager loop, to
  ``hal.moe_experts.reference_experts`` (float32, one expert at a time: the golden).
  Expert parallelism's local experts take the same kernel (``KernelSet.expert_rows``);
- ``optimizer``: AdamW's step, torch's ``fused`` kernel over each parameter's (DTensor)
  shard instead of ``foreach`` (torch registers ``_fused_adamw_`` for DTensor; torch_npu
  2.10.0.post4 implements it for NPU tensors, ``wrapper_NPU___fused_adamw_`` in its library).

``reference`` is today's eager code, the golden, and the CPU's set. CUDA takes Liger-Kernel's
Triton functions (``LigerRMSNormFunction`` in Llama casting mode, ``LigerSiLUMulFunction``,
``LigerRopeFunction``), the NPU torch_npu's own ops (``npu_rms_norm``, ``npu_swiglu`` on one
``[gate; up]`` projection, ``npu_rotary_mul`` in its BSND layout: ``hal.npu_kernels``), as
verl's NPU patch and MindSpeed's FSDP2 path call them. Each is patched onto the model **instance**
(its modules' ``forward``), before ``fully_shard``, never on a class or module at import, so
a reference model in the same process is untouched. A kernel that fails to load is never
chosen; one that fails to run falls back to the reference for the rest of the process,
reported once (``KernelSet.fall_back``), unless device memory ran out: that is re-raised. ``run.deterministic`` keeps the reference for an op
whose fused kernel has no deterministic mode (``Provider.deterministic``).

- ``lm_head``: the lean path's log-prob + entropy through the LM head
  (``trainer.loop.ranks.forward``): ``hal.fused_head``'s closed-form backward in place of the
  reference's checkpointed chunks. Our own, device-neutral torch code: no pinned library ships
  it with the entropy and a temperature (see that module). Set on the model instance as
  ``HEAD_KERNEL`` (the lean forward looks it up there); a head that is not a plain
  ``nn.Linear`` (LoRA on the head) takes the reference.

- ``compile``: each decoder layer's ``forward`` through ``torch.compile`` (inductor), before
  ``fully_shard`` (torchtitan's order: FSDP2's hooks stay outside it). The varlen attention
  breaks each layer's graph in two (its cached ``cu_seqlens`` check is data-dependent);
  torch runs a checkpointed region that has a graph break eagerly, and disables dynamo under
  a checkpoint called outside it, so the config refuses it beside activation checkpointing
  (checked again once ``auto`` sizes resolve). The ops inside a layer (``LAYER_OPS``) run the
  eager reference under it: inductor fuses them, a library's autograd function only breaks
  the graph. Every device offers it, none takes it
  unasked: ``train.compile_blocks`` turns it on, until a device run has measured it against
  the reference (a compile error at a layer's first call falls back to eager; one in a
  backward's first call cannot, and stops the step).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hal import moe_experts, npu_kernels

#: The ops a kernel set chooses for, in report order.
OPS = ("rms_norm", "swiglu", "rope", "moe_experts", "lm_head", "optimizer", "compile")
REFERENCE = "reference"
#: The ops inside a decoder layer: the eager reference under ``train.compile_blocks``.
LAYER_OPS = ("rms_norm", "swiglu", "rope", "moe_experts")
#: The model instance's attribute holding its fused LM head (``KernelSet.apply``).
HEAD_KERNEL = "crossrl_head_kernel"
#: HF RMSNorm classes whose forward is Llama's formula (the fused kernels compute exactly it).
RMS_NORM_CLASSES = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "MixtralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen2MoeRMSNorm",
        "Qwen3RMSNorm",
        "Qwen3MoeRMSNorm",
    }
)


@dataclass(frozen=True)
class Provider:
    """A fused implementation of one op: its name (what ``crossrl devices`` prints), how to
    load its function (``module``, ``attr``; None: nothing to load, e.g. a torch option),
    the calling convention of that function (``liger``: an autograd function's ``apply``;
    ``torch_npu``: the op) and whether it runs deterministically (element-wise, or reduced
    in a fixed order)."""

    name: str
    module: str | None = None
    attr: str | None = None
    deterministic: bool = True
    convention: str = "liger"


#: The fused head: one torch function for every device (``hal.fused_head``).
FUSED_HEAD = Provider(
    "crossrl-fused-head", "hal.fused_head", "linear_logprob_entropy", convention="crossrl"
)
#: Per-block compilation: torch's own, on every device, only with ``train.compile_blocks``
#: (inductor's kernels are not run-to-run deterministic by default).
COMPILE = Provider("torch.compile", deterministic=False)
#: The CPU's: the eager reference for every op unless compilation is asked for.
CPU = {"compile": COMPILE}
#: Per provider family, the fused kernel of each op (``DeviceBackend.kernel_providers``).
LIGER = {
    "rms_norm": Provider("liger", "liger_kernel.ops.rms_norm", "LigerRMSNormFunction"),
    "swiglu": Provider("liger", "liger_kernel.ops.swiglu", "LigerSiLUMulFunction"),
    "rope": Provider("liger", "liger_kernel.ops.rope", "LigerRopeFunction"),
    "moe_experts": Provider(
        "torch.grouped_mm", "torch.nn.functional", "grouped_mm", convention="torch"
    ),
    "lm_head": FUSED_HEAD,
    "optimizer": Provider("fused-adamw"),
    "compile": COMPILE,
}
TORCH_NPU = {
    # aclnnRmsNorm's gradient of gamma is reduced by the kernel in an order it does not
    # document as fixed: under run.deterministic the reference runs instead
    "rms_norm": Provider(
        "torch_npu.npu_rms_norm", "torch_npu", "npu_rms_norm", False, convention="torch_npu"
    ),
    "swiglu": Provider("torch_npu.npu_swiglu", "torch_npu", "npu_swiglu", convention="torch_npu"),
    "rope": Provider(
        "torch_npu.npu_rotary_mul", "torch_npu", "npu_rotary_mul", convention="torch_npu"
    ),
    "moe_experts": Provider(
        "torch_npu.npu_grouped_matmul", "torch_npu", "npu_grouped_matmul", convention="torch_npu"
    ),
    "lm_head": FUSED_HEAD,
    "optimizer": Provider("fused-adamw"),
    "compile": COMPILE,
}


def _rms_norm_call(provider: Provider, fn) -> Callable:
    """``(x, weight, eps) -> y`` through ``provider``'s function."""
    if provider.convention == "torch_npu":
        return npu_kernels.rms_norm_call(fn)
    # Liger: offset 0, Llama casting (fp32 normalisation, cast back, times the weight); the
    # incoming gradient is not overwritten in place (activation checkpointing reruns forward)
    return lambda x, weight, eps: fn.apply(x, weight, eps, 0.0, "llama", False)


def _swiglu_call(provider: Provider, fn) -> Callable:
    """``(mlp, x) -> silu(mlp.gate_proj(x)) * mlp.up_proj(x)`` through ``provider``'s
    function."""
    if provider.convention == "torch_npu":  # halves of one tensor: Swish(first) * second
        return npu_kernels.swiglu_call(fn)
    return lambda mlp, x: fn.apply(mlp.gate_proj(x), mlp.up_proj(x))


def _rope_call(provider: Provider, fn) -> Callable:
    """``(q, k, cos, sin) -> (q, k)`` rotated (q, k ``[B, H, S, D]``; cos, sin ``[B, S, D]``)
    through ``provider``'s function."""
    if provider.convention == "torch_npu":  # x * cos + rotate_half(x) * sin, one tensor a call
        return npu_kernels.rope_call(fn)
    return lambda q, k, cos, sin: fn.apply(q, k, cos, sin)


def _head_call(provider: Provider, fn) -> Callable:
    """``(hidden, head, targets, temperature, chunk_tokens) -> (logprob, entropy)``."""
    return lambda hidden, head, targets, temperature, chunk_tokens: fn(
        hidden, head.weight, head.bias, targets, temperature=temperature, chunk_tokens=chunk_tokens
    )


def _experts_call(provider: Provider, fn) -> moe_experts.ExpertsKernel:
    """The experts (``hal.moe_experts.ExpertsKernel``) through ``provider``'s grouped GEMM;
    on the NPU with the rest of torch_npu's MoE ops from the same module."""
    if provider.convention != "torch_npu":
        return moe_experts.torch_experts(fn)
    return moe_experts.npu_experts(fn, importlib.import_module(provider.module))


def _experts_fit(kernel: moe_experts.ExpertsKernel) -> Callable:
    """Whether a call's arguments suit ``kernel``'s grouped GEMM (torch's CUDA kernel takes
    bf16 only)."""
    return lambda module, hidden, index, weights: kernel.fits(hidden.dtype)


_CALLS = {
    "rms_norm": _rms_norm_call,
    "swiglu": _swiglu_call,
    "rope": _rope_call,
    "moe_experts": _experts_call,
    "lm_head": _head_call,
}


@dataclass
class KernelSet:
    """The kernel each op runs in this process (``chosen``: op -> name), why an op runs the
    reference where a fused kernel exists (``reasons``), and the loaded functions."""

    chosen: dict[str, str]
    reasons: dict[str, str] = field(default_factory=dict)
    calls: dict[str, Callable] = field(default_factory=dict)
    #: op -> the chosen provider's calling convention (``Provider.convention``)
    conventions: dict[str, str] = field(default_factory=dict)
    #: op -> whether a call's arguments suit its kernel (absent: always)
    fits: dict[str, Callable] = field(default_factory=dict)

    def report(self) -> dict[str, str]:
        """op -> kernel, with the reason after the reference where one was passed over."""
        return {
            op: self.chosen[op] + (f" ({self.reasons[op]})" if op in self.reasons else "")
            for op in OPS
        }

    def fall_back(self, op: str, err: BaseException) -> None:
        """``op``'s kernel failed to run: the reference from now on, said once."""
        if self.chosen[op] == REFERENCE:
            return
        failed = self.chosen[op]
        self.chosen[op] = REFERENCE
        self.reasons[op] = f"{failed} failed: {type(err).__name__}: {err}".splitlines()[0][:200]
        warnings.warn(
            f"crossrl: the {op} kernel {failed} failed ({self.reasons[op]}); the reference "
            "runs instead (same results, slower). `crossrl devices` shows the kernels.",
            RuntimeWarning,
            stacklevel=3,
        )

    def guarded(
        self, op: str, fused: Callable, reference: Callable, when: Callable | None = None
    ) -> Callable:
        """A call that runs ``fused`` while ``op`` runs its kernel (and ``when``, given the same
        arguments, holds), else ``reference``; a ``fused`` that raises makes ``op`` fall back
        (``fall_back``: said once) and this call runs ``reference``. Out of device memory
        (``hal.registry.is_out_of_memory``) is re-raised, never a fall-back: the reference
        needs more memory still, and inside a checkpoint's recompute it would save other
        tensors than the forward did."""

        def call(*args, **kwargs):
            if self.chosen[op] != REFERENCE and (when is None or when(*args, **kwargs)):
                try:
                    return fused(*args, **kwargs)
                except Exception as err:  # noqa: BLE001 - reported once, then the reference
                    from hal.registry import is_out_of_memory  # hal.registry imports this module

                    if is_out_of_memory(err):
                        raise
                    self.fall_back(op, err)
            return reference(*args, **kwargs)

        return call

    def optimizer_options(self) -> dict[str, bool]:
        """``torch.optim.AdamW`` keyword arguments for the chosen optimizer kernel."""
        return {"fused": True} if self.chosen["optimizer"] != REFERENCE else {"foreach": True}

    def apply(self, model: torch.nn.Module) -> dict[str, int]:
        """Patch ``model``'s own modules (their instance ``forward``) with the chosen kernels,
        before ``fully_shard``; returns the modules patched per op. Each patched forward runs
        the module's own forward once its op has fallen back. The fused head is set as the
        model's ``HEAD_KERNEL`` (``head_kernel``)."""
        patched = {"rms_norm": 0, "swiglu": 0, "rope": 0, "moe_experts": 0, "lm_head": 0}
        self._keep_scaled_rope(model)
        if "lm_head" in self.calls:
            model.__dict__[HEAD_KERNEL] = self.head_kernel
            patched["lm_head"] = 1
        for module in model.modules():
            if "rms_norm" in self.calls and type(module).__name__ in RMS_NORM_CLASSES:
                _patch(module, self, "rms_norm", _fused_rms_norm)
                patched["rms_norm"] += 1
            elif "swiglu" in self.calls and _is_swiglu_mlp(module):
                _patch(module, self, "swiglu", _fused_swiglu)
                patched["swiglu"] += 1
            elif "rope" in self.calls and _patch_rope(module, self):
                patched["rope"] += 1
            elif "moe_experts" in self.calls and moe_experts.is_fused_experts(module):
                _patch_experts(module, self)
                patched["moe_experts"] += 1
        return patched

    def _keep_scaled_rope(self, model: torch.nn.Module) -> None:
        """A rope that scales cos and sin (``attention_scaling`` other than 1: YaRN, LongRoPE)
        keeps the reference rotation where the kernel takes them in [-1, 1] only
        (``npu_kernels.ROPE_UNIT_RANGE``)."""
        if self.conventions.get("rope") not in npu_kernels.ROPE_UNIT_RANGE:
            return
        scaling = {
            float(getattr(m, "attention_scaling", 1.0))
            for m in model.modules()
            if type(m).__name__.endswith("RotaryEmbedding")
        } - {1.0}
        if scaling and self.chosen["rope"] != REFERENCE:
            self.reasons["rope"] = (
                f"{self.chosen['rope']} takes cos and sin in [-1, 1]; the rope's "
                f"attention_scaling={max(scaling):g} scales them beyond"
            )
            self.chosen["rope"] = REFERENCE
            self.calls.pop("rope", None)

    def compile_layers(self, layers) -> int:
        """Each of ``layers`` (the decoder layers, before ``fully_shard``) runs its ``forward``
        through ``torch.compile`` while ``compile`` is chosen; a layer whose compiled call
        raises runs eager from then on (``fall_back``). Returns the layers compiled."""
        if self.chosen["compile"] == REFERENCE:
            return 0
        for layer in layers:
            _compile_forward(layer, self)
        return len(layers)

    def expert_rows(self) -> Callable:
        """``(rows, gate_up, down, counts, act_fn) -> out``: experts over rows already grouped
        by expert (``hal.moe_experts.looped_rows``; expert parallelism's local experts)
        through the chosen experts kernel while it runs and suits the rows' dtype, else the
        per-expert loop."""
        kernel = self.calls.get("moe_experts")
        if kernel is None:
            return moe_experts.looped_rows
        return self.guarded(
            "moe_experts",
            kernel.rows,
            moe_experts.looped_rows,
            when=lambda rows, *_: kernel.fits(rows.dtype),
        )

    def head_kernel(self, hidden, head, targets, *, temperature, chunk_tokens, reference):
        """The LM head's (log-prob, entropy) per token through the fused head while it runs
        and ``head`` is a plain ``nn.Linear``; else (or once it failed) ``reference`` with the
        same arguments."""
        return self.guarded(
            "lm_head",
            lambda: self.calls["lm_head"](hidden, head, targets, temperature, chunk_tokens),
            lambda: reference(
                hidden, head, targets, temperature=temperature, chunk_tokens=chunk_tokens
            ),
            when=lambda: type(head).forward is torch.nn.Linear.forward,
        )()


def _compile_forward(layer: torch.nn.Module, kernels: KernelSet) -> None:
    own = layer.forward
    layer.forward = kernels.guarded("compile", torch.compile(own), own)


def _is_swiglu_mlp(module: torch.nn.Module) -> bool:
    """A gated MLP whose activation is SiLU: ``down(act(gate(x)) * up(x))``."""
    if not all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return False
    return moe_experts.is_silu(module.act_fn)


def _fused_rms_norm(module, call, hidden_states: torch.Tensor) -> torch.Tensor:
    return call(hidden_states, module.weight, module.variance_epsilon)


def _fused_swiglu(module, call, x: torch.Tensor) -> torch.Tensor:
    return module.down_proj(call(module, x))


def _patch(module: torch.nn.Module, kernels: KernelSet, op: str, fused: Callable) -> None:
    """``module.forward`` = ``fused`` with ``kernels.calls[op]`` while ``op`` runs its kernel,
    else the module's own forward (after a failure: ``KernelSet.fall_back``)."""
    call = kernels.calls[op]
    module.forward = kernels.guarded(op, lambda x: fused(module, call, x), module.forward)


def _patch_experts(module: torch.nn.Module, kernels: KernelSet) -> None:
    """``module.forward`` = the chosen experts kernel while it runs and suits the call
    (``KernelSet.fits``), else the module's own forward."""
    call, fits = kernels.calls["moe_experts"], kernels.fits.get("moe_experts")
    module.forward = kernels.guarded(
        "moe_experts",
        lambda hidden, index, weights: call(module, hidden, index, weights),
        module.forward,
        when=None if fits is None else lambda h, i, w: fits(module, h, i, w),
    )


def _patch_rope(module: torch.nn.Module, kernels: KernelSet) -> bool:
    """An attention module whose class's forward rotates q and k through its modeling
    module's ``apply_rotary_pos_emb`` (transformers 5's Llama / Qwen2 / Qwen3 attention)
    gets, as its own ``forward``, that very function with the fused rotation in that name's
    place (a copy of the function object with other globals: nothing of transformers is
    changed, no other instance sees it); the reference rotation again once the kernel has
    fallen back. Returns whether ``module`` was patched."""
    import inspect
    import types

    if not type(module).__name__.endswith("Attention"):
        return False
    raw = inspect.unwrap(type(module).forward)  # below transformers' kwarg-renaming wrapper
    reference = raw.__globals__.get("apply_rotary_pos_emb")
    if reference is None or "apply_rotary_pos_emb" not in raw.__code__.co_names:
        return False
    call = kernels.calls["rope"]
    rope = kernels.guarded(
        "rope",
        lambda q, k, cos, sin, unsqueeze_dim=1: call(q, k, cos, sin),
        reference,
        when=lambda q, k, cos, sin, unsqueeze_dim=1: unsqueeze_dim == 1,
    )
    scope = {**raw.__globals__, "apply_rotary_pos_emb": rope}
    rebuilt = types.FunctionType(
        raw.__code__, scope, raw.__name__, raw.__defaults__, raw.__closure__
    )
    rebuilt.__kwdefaults__ = raw.__kwdefaults__
    renamed = "cache" in inspect.signature(raw).parameters  # the wrapper's one job, kept

    def forward(*args, **kwargs):
        if renamed and "past_key_values" in kwargs:
            kwargs["cache"] = kwargs.pop("past_key_values")
        return rebuilt(module, *args, **kwargs)

    module.forward = forward
    return True


def choose_kernels(
    providers: dict[str, Provider],
    *,
    mode: str = "auto",
    reference_ops: tuple[str, ...] = (),
    deterministic: bool = False,
    optimizer_offload: bool = False,
    compile_blocks: bool = False,
) -> KernelSet:
    """The kernel set from a device's ``providers`` (op -> ``Provider``; absent: none fused):
    ``mode`` ``reference`` takes the reference everywhere; ``reference_ops`` for those ops
    alone; ``deterministic`` for ops whose kernel is not deterministic; ``optimizer_offload``
    keeps the reference optimizer (its step runs on the host's state); ``compile_blocks``
    (``train.compile_blocks``) takes ``compile`` where offered, and with it the reference for
    the ops inside a layer (``LAYER_OPS``: inductor fuses the eager code)."""
    chosen, reasons, calls, conventions, fits = {}, {}, {}, {}, {}
    for op in OPS:
        chosen[op] = REFERENCE
        provider = providers.get(op)
        if provider is None:
            continue
        if mode == "reference" or op in reference_ops:
            reasons[op] = "train.kernels" if mode == "reference" else "train.reference_kernels"
            continue
        if op == "compile" and not compile_blocks:
            reasons[op] = "train.compile_blocks=false"
            continue
        if deterministic and not provider.deterministic:
            reasons[op] = "run.deterministic: the fused kernel has no deterministic mode"
            continue
        if op in ("optimizer", "compile"):
            if op == "optimizer" and optimizer_offload:
                reasons[op] = "train.optimizer_offload: the step runs on the host"
                continue
            chosen[op] = provider.name
            continue
        try:
            fn = getattr(importlib.import_module(provider.module), provider.attr)
        except Exception as err:  # noqa: BLE001 - not installed, or broken: never chosen
            reasons[op] = f"{provider.name} did not load: {type(err).__name__}: {err}"
            reasons[op] = reasons[op].splitlines()[0][:200]
            continue
        chosen[op], calls[op] = provider.name, _CALLS[op](provider, fn)
        conventions[op] = provider.convention
        if op == "moe_experts":
            fits[op] = _experts_fit(calls[op])
    if chosen["compile"] != REFERENCE:
        # inductor fuses the eager ops of a compiled layer; an autograd function of a library
        # inside it only breaks the graph
        for op in LAYER_OPS:
            if chosen[op] != REFERENCE:
                chosen[op], reasons[op] = REFERENCE, "train.compile_blocks: inductor fuses it"
                calls.pop(op)
    return KernelSet(chosen, reasons, calls, conventions, fits)
