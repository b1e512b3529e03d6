"""The memory budget held against torch's own accounting: one training step of a config run
through crossrl's workers under ``FakeTensorMode`` with a fake process group, measured by
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (category by category, no
memory allocated, no device needed), beside the budget's update phase for the same keys.

``track_step(cfg, layers=L)`` builds the config's model shape with ``L`` decoder layers (None:
all of them) and runs, as one rank of ``train.dp_size``, what a step runs on a device:

- the reference's no-grad log-prob pass (``PolicyWorker.compute_logprobs``); what it still
  holds afterwards sits beside the actor's update;
- the actor's update: two mini-batches of two micro-batches of the budget's micro-batch tokens
  each (``PolicyWorker.train_mini_batch``: activation checkpointing, lean log-probs, the KL
  loss, gradient sync per micro-batch, clipping, AdamW), so the peak comes with optimizer
  state and the previous micro-batch's gradients present;
- with ``critic.enable`` the critic's update the same way (it runs at once, in its own
  process on the same device).

What cannot run under fake mode, and is replaced here (nothing else is):

- loading weights (``ModelLoading._load_initial_weights`` reads safetensors and broadcasts real
  data): the sharded model is only materialised (``to_empty``) with fake storage;
- the device's attention kernel: flash-attn is a compiled GPU extension that fake tensors cannot
  enter, and the CPU reference kernel materialises ``[heads, s, s]`` scores the device never
  holds. ``_FlashMemory`` holds what flash-attn 2's varlen kernel holds: q, k, v, the output
  and the float32 log-sum-exp for backward; dq, key/value gradients expanded to all heads and
  a float32 dq accumulator during its backward;
- reading numbers back to the host (``float(loss)``, ``.item()``, ``.numpy()`` of a fake
  tensor) gives zeros: fake tensors have no values. Batch bookkeeping on real tensors
  (plans, normalisers, masks) runs for real, outside fake mode;
- the device mesh is built outside fake mode (it holds real rank tensors), and the worker
  joins the fake group instead of creating one.

The tracker keys memory by device; everything here is on the (fake) CPU device, which stands
for one accelerator: the budget is read for ``cfg.device`` (its accelerator type).
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainer.config.schema import Config
from trainer.loop.plan.memory_budget import GB, MemoryBudget, estimate_memory
from trainer.loop.plan.model_shape import ModelShape, model_shape
from trainer.loop.plan.rank_memory import micro_batch_tokens

__all__ = ["TrackedStep", "format_comparison", "measured_update", "track_step"]

#: The tracker's categories (``_FSDPRefType`` values) in the order the table prints them.
CATEGORIES = (
    "Sharded Param",
    "Unsharded Param",
    "Sharded Grad",
    "Unsharded Grad",
    "All Gather",
    "Reduce Scatter",
    "OptState",
    "Activation",
    "Temp",
    "Buffer",
    "Inputs",
)


#: The tracker's categories FSDP2's CPU offload (``train.param_offload``) keeps on the host.
HOST_CATEGORIES = ("Sharded Param", "Sharded Grad", "OptState")


@dataclass(frozen=True)
class TrackedStep:
    """One rank's step under the tracker: bytes by tracker category, per role (``actor`` and
    ``critic`` at their peak, ``reference`` what it holds after its pass), and the shape run."""

    roles: dict[str, dict[str, float]]
    shape: ModelShape
    micro_batch_tokens: int

    def total(self, role: str) -> float:
        """Bytes of ``role`` (0 when the step has no such role)."""
        return float(sum(self.roles.get(role, {}).values()))

    @property
    def update(self) -> float:
        """Bytes on one device during the update: every role's, as the budget adds them."""
        return float(sum(self.total(role) for role in self.roles))

    def on_device(self, param_offload: bool) -> float:
        """``update`` without what ``train.param_offload`` keeps in host memory: FSDP2's CPU
        offload holds the sharded parameters and gradients there, and the optimizer steps
        there, while the tracker counts every tensor where it was made."""
        if not param_offload:
            return self.update
        host = sum(self.roles[role].get(cat, 0.0) for role in self.roles for cat in HOST_CATEGORIES)
        return self.update - float(host)


class _FlashMemory(torch.autograd.Function):
    """flash-attn 2 varlen's memory, without its arithmetic (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v):  # noqa: D102 - autograd's protocol
        out = torch.empty_like(q)
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102 - autograd's protocol
        q, k, _, _, lse = ctx.saved_tensors
        tokens, heads, dim = q.shape
        groups = heads // k.shape[1]
        accum = q.new_empty(q.shape, dtype=torch.float32)  # noqa: F841 - held by the kernel
        softmax_d = torch.empty_like(lse)  # noqa: F841 - held by the kernel
        dq = torch.empty_like(q)
        dk = torch.empty_like(q).view(tokens, -1, groups, dim).sum(2)
        dv = torch.empty_like(q).view(tokens, -1, groups, dim).sum(2)
        return dq, dk, dv


def _fake_attention(q, k, v, cu_seqlens, **_kwargs):
    return _FlashMemory.apply(q, k, v)


class _HostSide(TorchDispatchMode):
    """A dispatch mode inside fake mode: an op on real tensors only runs for real (the batch's
    bookkeeping), a value read from a fake tensor is 0, and a fake tensor indexed by a real
    boolean mask takes the mask's positions (fake tensors cannot compute a data-dependent
    shape)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
        if func is torch.ops.aten.index.Tensor:
            with unset_fake_temporarily():
                index = [
                    i.nonzero().squeeze(-1)
                    if i is not None and i.dtype == torch.bool and not isinstance(i, FakeTensor)
                    else i
                    for i in args[1]
                ]
            return func(args[0], index)
        return func(*args, **kwargs)


class _HostArrays(TorchFunctionMode):
    """``.numpy()`` of a fake tensor: zeros of its shape (a function mode, as ``numpy`` is no
    dispatched op)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if func is torch.Tensor.numpy and isinstance(args[0], FakeTensor):
            return np.zeros(tuple(args[0].shape), dtype=np.float32)
        return func(*args, **(kwargs or {}))


def _step_tracker(model, optimizer):
    """An ``FSDPMemTracker`` that follows crossrl's lean forward: that method runs the root's
    FSDP hooks itself (``register_fsdp_forward_method``), not through the module call the
    tracker instruments, and a step calls the root's forward once per micro-batch."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class StepTracker(FSDPMemTracker):
        def _fsdp_state_pre_forward(self, fsdp_mod, orig):
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def pre(*args, **kwargs):
                # The tracker refuses a second forward of the root (it expects one per
                # iteration); its per-module statistics are not what is read here.
                if fsdp_mod is self._root_mod and not self._mod_tracker.is_bw:
                    self.memory_tracking.pop(fsdp_mod, None)
                return inner(*args, **kwargs)

            return pre

        def _register_module_and_optimizer_hooks(self):
            super()._register_module_and_optimizer_hooks()
            root = self._root_mod
            state = root._get_fsdp_state()
            self._mod_tracker._get_mod_name(root)
            state._pre_forward = self._fsdp_state_pre_forward(root, state._pre_forward)
            state._post_forward = self._fsdp_state_post_forward(root, state._post_forward)

        def _deregister_module_and_optimizer_hooks(self):
            state = self._root_mod._get_fsdp_state()
            state.__dict__.pop("_pre_forward", None)
            state.__dict__.pop("_post_forward", None)
            super()._deregister_module_and_optimizer_hooks()

    return StepTracker(model, optimizer)


def _by_category(snapshot: dict) -> dict[str, float]:
    out = dict.fromkeys(CATEGORIES, 0.0)
    for device_snap in snapshot.values():
        for key, value in device_snap.items():
            name = getattr(key, "value", str(key))
            if name in out:
                out[name] += float(value)
    return out


def _model_dir(shape_config: dict, layers: int | None, root: Path) -> Path:
    """A directory with the ``config.json`` of the shape (``layers`` decoder layers), made by
    transformers' config class of its ``model_type`` (Qwen2 where it names none)."""
    from transformers import AutoConfig

    config = {**shape_config}
    if layers is not None:
        config["num_hidden_layers"] = layers
    directory = root / "model"
    AutoConfig.for_model(config.pop("model_type", "qwen2"), **config).save_pretrained(directory)
    return directory


def _shape_config(cfg: Config) -> dict:
    """The ``config.json`` fields of ``model.path``'s shape (``model_shape``): a mixture of
    experts' own config.json, else a Qwen2 of its sizes."""
    shape = model_shape(cfg.model.path)
    if shape is None:
        raise ValueError(
            f"model.path={cfg.model.path!r}: its shape is unknown (no config.json there and no "
            "published Qwen2.5 name), so the step cannot be tracked; point model.path at a "
            "model directory"
        )
    if shape.config is not None:
        return dict(shape.config)
    return {
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "intermediate_size": shape.intermediate_size,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "head_dim": shape.head_dim,
        "model_type": "qwen2",
    }


def _batch(cfg: Config, tokens: int, micro_batches: int):
    """Rows filling ``micro_batches`` micro-batches of ``tokens`` tokens, each row at most a
    row's length (``rollout.max_input_len + max_new_tokens``), half prompt, no two sharing a
    prompt; and the row indices of each micro-batch."""
    from batching import Row, StepBatch

    longest = cfg.rollout.max_input_len + cfg.rollout.max_new_tokens
    per = -(-tokens // longest)
    lens = [tokens // per + (1 if j < tokens % per else 0) for j in range(per)]
    rng = np.random.default_rng(0)
    rows, groups = [], []
    for m in range(micro_batches):
        groups.append(list(range(len(rows), len(rows) + per)))
        for j, n in enumerate(lens):
            prompt = max(1, n // 2)
            rows.append(
                Row(
                    prompt_ids=rng.integers(10, 1000, prompt).tolist(),
                    response_ids=rng.integers(10, 1000, n - prompt).tolist(),
                    response_mask=[1] * (n - prompt),
                    response_logprobs=[-1.0] * (n - prompt),
                    uid=m,
                    trajectory_id=len(rows),
                    step_index=0,
                    is_last_step=True,
                    score=float(j % 2),
                )
            )
    return StepBatch.from_rows(rows), groups


@contextlib.contextmanager
def _fake_world(dp_size: int):
    """A fake process group of ``dp_size`` ranks (this process is rank 0), the HAL's CPU
    attention replaced by ``_FlashMemory``, and the pieces named in the module docstring
    patched for the duration."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import hal.attention
    from rollout.models import reset_non_persistent_buffers
    from trainer.loop.ranks import model_loading

    if dist.is_initialized():
        raise RuntimeError("track_step needs a process without a torch.distributed group")
    dist.init_process_group("fake", rank=0, world_size=dp_size, store=FakeStore())
    real_mesh = device_mesh.init_device_mesh

    def mesh(*args, **kwargs):
        with unset_fake_temporarily():
            return real_mesh(*args, **kwargs)

    def materialise(self, model, own):
        tied = model_loading.tied_parameter_names(model)
        model.to_empty(device=self.device)
        model_loading.retie(model, tied)
        reset_non_persistent_buffers(model, self.device)

    kernel = hal.attention._KERNELS["cpu"]
    # The backend is one instance per process (``hal.get_backend``): the workers join the
    # fake group instead of creating one, and every later worker gets the real method back.
    saved = [
        (device_mesh, "init_device_mesh", mesh),
        (model_loading.ModelLoading, "_load_initial_weights", materialise),
        (kernel, "varlen_attention", _fake_attention),
        (hal.get_backend("cpu"), "init_process_group", _joined_fake_group),
    ]
    before = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in saved]
    try:
        for obj, name, value in saved:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in before:
            if value is None:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
        dist.destroy_process_group()


def _joined_fake_group(*_args, **_kwargs) -> bool:
    """``DeviceBackend.init_process_group`` inside ``_fake_world``: the fake group is there
    already (False: this call created none)."""
    return False


def _worker(cls, role: str, cfg: Config):
    from trainer.loop.ranks.spec import WorkerSpec

    return cls(WorkerSpec(role=role, rank=0, cfg=cfg))


def track_step(cfg: Config, layers: int | None = None) -> TrackedStep:
    """One step of ``cfg`` on one rank under ``FSDPMemTracker`` (module docstring), with the
    model's shape cut to ``layers`` decoder layers (None: the shape's own depth)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainer.loop.plan.layout import training_roles
    from trainer.loop.ranks.critic import CriticWorker
    from trainer.loop.ranks.policy import PolicyWorker

    shape_config = _shape_config(cfg)
    tokens = micro_batch_tokens(cfg)
    roles: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, _fake_world(cfg.train.dp_size):
        path = _model_dir(shape_config, layers, Path(tmp))
        cfg = cfg.model_copy(deep=True)
        cfg.device = "cpu"
        cfg.model.path = str(path)
        cfg.model.critic_path = None
        cfg.train.share_prompts = False  # rows share no prompt here; the budget counts T
        shape = model_shape(str(path))
        batch, groups = _batch(cfg, tokens, 4)
        arrays = batch.to_numpy()
        everything = list(range(batch.num_rows))
        zeros = np.zeros(batch.num_tokens, np.float32)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        classes = {"actor": PolicyWorker, "reference": PolicyWorker, "critic": CriticWorker}
        plan = [(role, classes[role]) for role in training_roles(cfg)]  # LoRA: no reference
        for role, cls in plan:
            worker = _worker(cls, role, cfg)
            with fake:
                worker.setup("127.0.0.1", 0)
            worker.load_batch([arrays])
            for name in ("old_logprobs", "ref_logprobs", "values"):
                worker.set_token_field(name, [(np.arange(batch.num_rows), zeros)])
            worker.compute_advantages(mismatch=False)
            with fake:
                tracker = _step_tracker(worker.model, worker.optimizer)
                with tracker, _HostSide(), _HostArrays():
                    if role == "reference":
                        worker.compute_logprobs(groups)
                    else:
                        for m in range(2):
                            minis = groups[2 * m : 2 * m + 2]
                            if role == "critic":
                                worker.train_mini_batch(minis, everything)
                            else:
                                worker.train_mini_batch(minis, everything, old_from_update=m == 0)
                kind = "current" if role == "reference" else "peak"
                roles[role] = _by_category(tracker.get_tracker_snapshot(kind))
            del worker, tracker
    return TrackedStep(roles=roles, shape=shape, micro_batch_tokens=tokens)


def measured_update(cfg: Config, step: TrackedStep) -> tuple[MemoryBudget, float, float]:
    """The budget of ``cfg`` at ``step``'s shape on ``cfg.device`` and, to compare with the
    tracker's ``step.update``, its update phase without the device contexts (no tensors) and
    the kernel set's own buffers (the tracker runs the reference kernels), and the tracker's
    update on the device (``TrackedStep.on_device``: without what ``train.param_offload``
    keeps on the host); returns ``(budget, estimate bytes, tracker bytes)``."""
    from hal import DEFAULT_DEVICE_MEMORY_BYTES

    # A config for the CPU (or auto) is measured as on the first default accelerator.
    device = (
        cfg.device
        if cfg.device in DEFAULT_DEVICE_MEMORY_BYTES
        else next(iter(DEFAULT_DEVICE_MEMORY_BYTES))
    )
    budget = estimate_memory(cfg, step.shape, DEFAULT_DEVICE_MEMORY_BYTES[device], device=device)
    update = budget.phase("update")
    apart = update.parts["ctx"] + update.parts.get("kernel", 0.0)
    return budget, update.total - apart, step.on_device(cfg.train.param_offload)


def format_comparison(cfg: Config, step: TrackedStep) -> str:
    """The table ``crossrl layout --measure`` prints: the tracker's bytes per role and
    category, the budget's update phase per component, and the ratio of the totals."""
    budget, estimate, tracked = measured_update(cfg, step)
    shape = step.shape
    lines = [
        f"memory measured by torch's FSDPMemTracker (fake tensors, one rank of "
        f"{cfg.train.dp_size}; GB = 1e9 bytes):",
        f"  shape: {shape.num_hidden_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_params / 1e9:.2f}e9 parameters; micro-batch {step.micro_batch_tokens:,} "
        "tokens",
        "  " + f"{'tracker category':<18}" + "".join(f"{r:>11}" for r in step.roles),
    ]
    for cat in CATEGORIES:
        cells = [step.roles[r].get(cat, 0.0) for r in step.roles]
        if any(cells):
            lines.append("  " + f"{cat:<18}" + "".join(f"{c / GB:11.2f}" for c in cells))
    lines.append(
        "  " + f"{'total':<18}" + "".join(f"{step.total(r) / GB:11.2f}" for r in step.roles)
    )
    update = budget.phase("update")
    lines.append("  budget's update phase:")
    shown = {k: v for k, v in update.parts.items() if k not in ("ctx", "kernel")}
    lines.append("    " + "".join(f"{k:>8}" for k in shown))
    lines.append("    " + "".join(f"{v / GB:8.2f}" for v in shown.values()))
    lines.append(
        f"  update without device contexts: estimate {estimate / GB:.2f} GB, tracker "
        f"{tracked / GB:.2f} GB, estimate / tracker {estimate / tracked:.3f}"
    )
    return "\n".join(lines)
