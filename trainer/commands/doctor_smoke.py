"""The smoke tests of `crossrl doctor`: a few seconds of real work on the job's device.

1. attention: a tiny model's forward and backward on packed rows through the HAL's varlen
   kernel on the device, against the same sequences run one by one on the CPU in float32;
2. all_reduce: a one-process group on the backend's collective library;
3. generate: a few tokens from the HF engine on the device (vLLM is only import-checked).
"""

from __future__ import annotations

import socket
import warnings

from hal.doctor_facts import FAIL, NOT_PRESENT, OK, WARN, Check

LENS = (5, 11, 3)
"""Tokens of the three sequences packed into the smoke test's one row."""
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
"""Largest max-abs error relative to the CPU reference's max-abs value, per device dtype."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rel_err(got, want) -> float:
    """max |got - want| / max |want|, both taken to CPU float32."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def _packed_inputs(vocab: int):
    import torch

    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in LENS]
    positions = torch.cat([torch.arange(n) for n in LENS])
    cu_seqlens = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    weights = torch.randn(sum(LENS), vocab, generator=gen)  # every logit gets its own gradient
    return seqs, positions, cu_seqlens, weights


def attention_smoke(backend) -> Check:
    """Packed forward/backward on the device through the HAL's kernel vs. the same sequences
    one by one through transformers' sdpa on the CPU in float32 (same weights: one seed)."""
    import torch

    import hal
    from rollout.models import load_model

    hal.register_attention()
    dtype = "bfloat16" if backend.is_accelerator else "float32"
    device = backend.device(0)
    ref = load_model("builtin:tiny")  # transformers' own sdpa: the reference
    model = load_model(
        "builtin:tiny", attn_implementation=hal.ATTN_IMPLEMENTATION, dtype=dtype, device=device
    )
    seqs, positions, cu_seqlens, weights = _packed_inputs(ref.config.vocab_size)

    want = torch.cat([ref(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    (want * weights).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        got = hal.packed_forward(
            model, torch.cat(seqs).to(device), positions.to(device), cu_seqlens.to(device)
        )
        (got.float() * weights.to(device)).sum().backward()
        backend.synchronize()
    grads = dict(model.named_parameters())
    logit_err = _rel_err(got, want)
    grad_err = max(_rel_err(grads[n].grad, p.grad) for n, p in ref.named_parameters())
    tol = TOLERANCE[dtype]
    detail = (
        f"packed fwd+bwd on {device} {dtype} vs separate rows on cpu float32: relative error "
        f"logits {logit_err:.1e}, grads {grad_err:.1e} (limit {tol:.0e}); "
        f"kernel: {backend.attention_impl_name}"
    )
    if not (logit_err <= tol and grad_err <= tol):
        return Check(
            "smoke: attention",
            FAIL,
            detail,
            "the varlen attention kernel gives wrong results here: check the kernel's package "
            "version against torch (rows above) and run tests/test_hal_attention.py",
        )
    fallbacks = [str(w.message) for w in caught if str(w.message).startswith("crossrl:")]
    if fallbacks:
        return Check("smoke: attention", WARN, f"{detail}; {fallbacks[0]}", "see the kernel rows")
    return Check("smoke: attention", OK, detail)


def all_reduce_smoke(backend) -> Check:
    """A one-process group on the backend's collective library, one all_reduce, torn down."""
    import torch
    import torch.distributed as dist

    name = "smoke: all_reduce"
    if dist.is_initialized():
        return Check(name, NOT_PRESENT, "skipped: this process already has a process group")
    backend.init_process_group(
        0, 1, master_addr="127.0.0.1", master_port=_free_port(), timeout_s=60.0, local_rank=0
    )
    try:
        tensor = torch.full((4,), 3.0, device=backend.device(0))
        dist.all_reduce(tensor)
        result = tensor.cpu().tolist()
    finally:
        dist.destroy_process_group()
    detail = f"{backend.process_group_backend}, 1 rank on {backend.device(0)}: sum {result}"
    if result != [3.0] * 4:
        return Check(name, FAIL, detail, "the collective library returns wrong sums; reinstall it")
    return Check(name, OK, detail)


def generate_smoke(backend, rollout_engine: str) -> Check:
    """Four tokens for one prompt from the HF engine on the device; vLLM is not started here."""
    name = "smoke: generate"
    if rollout_engine != "hf":
        return Check(name, NOT_PRESENT, f"{rollout_engine} not started by doctor (import above)")
    import math

    from rollout.engines import GenerationRequest, SamplingParams, make_engine
    from rollout.models import load_model
    from rollout.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("builtin")
    dtype = "bfloat16" if backend.is_accelerator else "float32"
    model = load_model("builtin:tiny", dtype=dtype, device=backend.device(0))
    engine = make_engine("hf", model, tokenizer)
    prompt = tokenizer("1 + 2 =")["input_ids"]
    (result,) = engine.generate(
        [GenerationRequest(prompt_ids=prompt, seed=0)], SamplingParams(max_new_tokens=4)
    )
    detail = f"hf engine on {backend.device(0)}: {len(result.token_ids)} tokens ({dtype})"
    good = 1 <= len(result.token_ids) <= 4 and len(result.logprobs) == len(result.token_ids)
    if not (good and all(math.isfinite(x) and x <= 0 for x in result.logprobs)):
        return Check(name, FAIL, f"{detail}, logprobs {result.logprobs}", "run `crossrl devices`")
    return Check(name, OK, detail)


def smoke_checks(backend, rollout_engine: str) -> list[Check]:
    """Every smoke test; one that raises becomes a FAIL row naming the error."""
    rows = []
    for name, run in (
        ("smoke: attention", lambda: attention_smoke(backend)),
        ("smoke: all_reduce", lambda: all_reduce_smoke(backend)),
        ("smoke: generate", lambda: generate_smoke(backend, rollout_engine)),
    ):
        try:
            rows.append(run())
        except Exception as err:  # a broken stack is the finding, not a crash of the doctor
            why = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            rows.append(Check(name, FAIL, why, "see the version and setting rows above"))
    return rows
