"""The kernel set's own ops (``hal.kernels``): the LM head's fused log-prob + entropy
(``hal.fused_head``, op ``lm_head``) against the lean path's reference chunks, and per-block
compilation (op ``compile``, ``train.compile_blocks``) against the eager model, on the CPU in
fp32. The model helpers are ``tests/test_kernels.py``'s."""

from __future__ import annotations

import warnings

import pytest
import torch

import hal
from hal.kernels import COMPILE, FUSED_HEAD, HEAD_KERNEL, choose_kernels
from tests.test_kernels import _run, _tiny


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("entropy_grad", [True, False], ids=["entropy-grad", "entropy-detached"])
def test_the_fused_head_gives_the_reference_chunks_values_and_gradients(
    temperature, bias, entropy_grad
):
    """``hal.fused_head`` against the lean path's checkpointed chunks: log-probs, entropies and
    the gradients of hidden states, weight and bias, with chunks that do not divide the tokens."""
    from hal.fused_head import linear_logprob_entropy
    from trainer.loop.ranks.forward import head_logprobs_entropy

    torch.manual_seed(0)
    head = torch.nn.Linear(12, 40, bias=bias)
    targets = torch.randint(0, 40, (23,))
    upstream = torch.randn(2, 23)
    out = {}
    for name in ("reference", "fused"):
        head.zero_grad()
        hidden = torch.randn(23, 12, generator=torch.Generator().manual_seed(1)).requires_grad_()
        if name == "reference":
            lp, ent = head_logprobs_entropy(
                hidden, head, targets, temperature=temperature, chunk_tokens=6
            )
        else:
            lp, ent = linear_logprob_entropy(
                hidden, head.weight, head.bias, targets, temperature=temperature, chunk_tokens=6
            )
        if not entropy_grad:
            ent = ent.detach()
        (upstream[0] * lp + upstream[1] * ent).sum().backward()
        grads = [hidden.grad] + [p.grad for p in head.parameters()]
        out[name] = [lp.detach(), ent.detach(), *grads]
    for got, want in zip(out["fused"], out["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_head_that_is_not_a_plain_linear_takes_the_reference():
    """LoRA on the LM head (a wrapper module) runs the reference chunks; the model instance
    alone holds the fused head, nothing is added to its state."""

    class Wrapped(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    kernels = choose_kernels({"lm_head": FUSED_HEAD})
    model = _tiny()
    assert kernels.apply(model)["lm_head"] == 1 and HEAD_KERNEL in vars(model)
    assert HEAD_KERNEL not in vars(_tiny()) and HEAD_KERNEL not in model.state_dict()
    calls = []

    def reference(hidden, head, targets, *, temperature, chunk_tokens):
        calls.append(type(head).__name__)
        return hidden.sum(-1), hidden.sum(-1)

    hidden, targets = torch.randn(4, 8), torch.zeros(4, dtype=torch.long)
    args = {"temperature": 1.0, "chunk_tokens": 2, "reference": reference}
    model.crossrl_head_kernel(hidden, Wrapped(8, 5), targets, **args)
    model.crossrl_head_kernel(hidden, torch.nn.Linear(8, 5), targets, **args)
    assert calls == ["Wrapped"] and kernels.chosen["lm_head"] == FUSED_HEAD.name


def _micro_batches(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Two packed micro-batches of different lengths, each its own forward and backward
    (as the update runs them; the second shape makes dynamo recompile), gradients summed."""
    from trainer.loop.ranks.forward import packed_token_logprobs

    outputs = []
    for lengths in ((7, 9), (5, 11, 4)):
        ids = torch.arange(3, 3 + sum(lengths))
        positions = torch.cat([torch.arange(n) for n in lengths])
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0)], dtype=torch.int32)
        logprobs, entropy = packed_token_logprobs(
            model, ids, positions, cu_seqlens, temperature=0.7, entropy_grad=True
        )
        weights = torch.linspace(-1, 1, ids.numel())
        ((weights * logprobs).sum() + (weights * entropy).sum()).backward()
        outputs += [logprobs.detach(), entropy.detach()]
    return torch.cat(outputs), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_compiled_blocks_give_the_references_values_and_gradients():
    """``train.compile_blocks``: every decoder layer through ``torch.compile`` (inductor, the
    CPU's C++ backend here) against the eager model in fp32, over two micro-batches of the
    lean path; nothing fell back."""
    from torch._dynamo.utils import counters

    from trainer.loop.ranks.model_loading import decoder_layers

    kernels = choose_kernels(hal.get_backend("cpu").kernel_providers, compile_blocks=True)
    reference, compiled = _tiny(), _tiny()
    reference.train(), compiled.train()
    layers = decoder_layers(compiled)
    assert kernels.compile_layers(layers) == len(layers) > 0
    want, want_grads = _micro_batches(reference)
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    got, got_grads = _micro_batches(compiled)
    assert counters["stats"]["unique_graphs"] > graphs  # dynamo did capture the layers
    assert kernels.chosen["compile"] == "torch.compile", kernels.reasons
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_layer_whose_compilation_fails_runs_eager_reported(monkeypatch):
    def no_compiler(fn, **kwargs):
        def compiled(*args, **kwargs):
            raise RuntimeError("InductorError: CppCompileError: C++ compile error")

        return compiled

    monkeypatch.setattr(torch, "compile", no_compiler)
    kernels = choose_kernels({"compile": COMPILE}, compile_blocks=True)
    reference, compiled = _tiny(), _tiny()
    assert kernels.compile_layers(compiled.model.layers) == len(compiled.model.layers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _ = _run(compiled)
    assert sum("compile kernel torch.compile failed" in str(w.message) for w in caught) == 1
    assert kernels.report()["compile"].startswith("reference (torch.compile failed: Runtime")
    torch.testing.assert_close(got, _run(reference)[0])


def _head_ops(entropy: str, dtype=torch.float32):
    """The aten ops one backward of ``hal.fused_head`` runs (name -> output shapes), and the
    gradients, for a ``[40, 12]`` head over 23 tokens in chunks of 6; ``entropy``: ``used``
    (in the loss), ``zero`` (in it with weight 0) or ``detached``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hal.fused_head import linear_logprob_entropy

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: dict[str, list[tuple[int, ...]]] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else ()
            self.ops.setdefault(func.overloadpacket.__name__, []).append(shape)
            return out

    torch.manual_seed(0)
    weight = torch.randn(40, 12).to(dtype).requires_grad_()
    hidden = torch.randn(23, 12).to(dtype).requires_grad_()
    targets = torch.randint(0, 40, (23,))
    lp, ent = linear_logprob_entropy(hidden, weight, None, targets, chunk_tokens=6)
    upstream = torch.linspace(-1, 1, 23)
    loss = (upstream * lp).sum()
    if entropy != "detached":
        loss = loss + (upstream * ent).sum() * (1.0 if entropy == "used" else 0.0)
    with Ops() as mode:
        loss.backward()
    return mode.ops, (hidden.grad, weight.grad)


def test_the_head_weights_gradient_is_summed_in_place_and_an_absent_entropy_skipped():
    """Backward sums each chunk's weight gradient into the float32 accumulator with one
    ``addmm`` (no ``[V, H]`` temporary per chunk), and an entropy without a gradient
    (detached) skips its term: none of its ``sub``, the same gradients as a zero one."""
    used, _ = _head_ops("used")
    zero, want = _head_ops("zero")
    detached, got = _head_ops("detached")
    assert (40, 12) not in used.get("mm", [])  # no per-chunk [V, H] product
    assert used["addmm_"].count((40, 12)) == 4  # one per chunk, into the accumulator
    assert "sub_" in used and "sub_" not in detached
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_device_without_a_float32_output_for_bf16_sums_the_product():
    """torch 2.13's CPU has no ``addmm.dtype_out`` kernel: asked once, the bf16 product is
    added to the float32 accumulator (the formula before), with the same gradient within
    bf16's rounding."""
    from hal import fused_head

    assert fused_head._fp32_accumulates(torch.device("cpu"), torch.bfloat16) is False
    assert fused_head._FP32_ACCUMULATE[("cpu", torch.bfloat16)] is False
    ops, (_, grad_bf16) = _head_ops("used", torch.bfloat16)
    assert (40, 12) in ops["mm"]  # the compute dtype's product, the fallback
    _, (_, grad_fp32) = _head_ops("used")
    torch.testing.assert_close(grad_bf16.float(), grad_fp32, rtol=0.05, atol=0.05)
