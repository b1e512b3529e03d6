"""HF transformers engine: batched sampling with our own loop on any torch device.

Why our own loop rather than ``model.generate``: every request samples from its own
``torch.Generator`` seeded from ``GenerationRequest.seed``, so what a request samples does not
depend on which requests share its batch (up to float effects of padding), and the logprob of
each sampled token is ``log_softmax(logits / temperature)`` before top-p/top-k filtering, exactly
the distribution the trainer evaluates.

The uniform numbers behind each draw come from a CPU generator and the draw is an inverse-CDF
lookup, so the sampler's random stream is the same on every device type.

Where the time goes (``builtin:small``, 32 prompts x 8 samples, 25 prompt tokens, 15 new tokens,
one CPU thread): a decode step is mostly the linear layers, so the loop does as few token
forwards as it can. Each DISTINCT prompt is prefilled once and its KV cache and last logits are
copied to the rows that continue it (the n samples of a GRPO group: 8x fewer prefill tokens),
and a head common to all distinct prompts (chat template opening, system prompt) is prefilled
once when that saves enough tokens;
the KV cache is written in place into buffers sized for the whole call
(``rollout/engines/hf/kv_buffer.py``) instead of growing by ``torch.cat`` each step; rows that
sampled a stop token leave the batch once they are an eighth of it; only the last position's
logits are computed. A request's tokens and logprobs do not depend on which of these paths it
took, beyond float effects of the batch's shape.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from collections.abc import Callable, Iterable

import torch

from rollout.engines.base import (
    WAKE_TAGS,
    Engine,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from rollout.engines.hf.kv_buffer import KVArena
from rollout.engines.hf.sampler import filter_logits, sample_inverse_cdf
from rollout.engines.hf.steps import Admit, DecodeBatch, OnResult
from rollout.moe_routing import control_routers, prompt_routes, recording

__all__ = ["HFEngine", "filter_logits", "sample_inverse_cdf"]

#: The distinct prompts' common head is prefilled once (one extra forward) when that saves at
#: least this many prompt tokens: below it, the extra call costs about what it saves.
_MIN_SHARED_HEAD_TOKENS = 256


class HFEngine(Engine):
    """Generation with a transformers causal LM (any torch device; the CPU default).

    ``model``: a loaded ``PreTrainedModel`` on its device. ``pad_token_id``: id fed for left
    padding and for finished rows (never attended to). ``max_batch_size``: requests per forward
    pass (requests are sorted by prompt length first, to keep padding low).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        pad_token_id: int | None = None,
        max_batch_size: int = 256,
        routed_experts: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: must be >= 1 request")
        self.model = model
        self.tokenizer = tokenizer
        if pad_token_id is None:
            pad_token_id = getattr(tokenizer, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(model.config, "pad_token_id", None) or 0
        self.pad_token_id = int(pad_token_id)
        self.max_batch_size = max_batch_size
        self._device = next(model.parameters()).device
        # Logits of the last position only (what sampling reads), where the model allows it:
        # a prefill's full [rows, width, vocab] logits are large for real vocabularies.
        params = inspect.signature(model.forward).parameters
        self._last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        # The KV cache's keyword: ``cache`` from transformers 5.2x (``past_key_values`` is
        # deprecated there and warns on every call), ``past_key_values`` before.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._arena = KVArena()  # KV cache memory, kept between calls until sleep()
        self._lock = threading.Lock()  # one generate call at a time (they share the arena)
        self._awake: set[str] = set(WAKE_TAGS)
        # A mixture's routing, returned per request (``routed_experts``: what vLLM's
        # enable_return_routed_experts gives): the routers record what they choose.
        self.return_routes = routed_experts and bool(
            control_routers(model, required="algorithm.routing_replay")
        )

    interruptible = True  # ``interrupt`` is polled after every decode step
    abortable = True  # ``abort_groups`` too: one group's requests end, the others go on
    joinable = True  # ``admit`` too: requests join the running batch between decode steps

    @property
    def device(self) -> torch.device:
        """The torch device the model runs on (while awake)."""
        return self._device

    @property
    def awake_tags(self) -> tuple[str, ...]:
        """What is awake, among ``WAKE_TAGS``: both after start and after a full ``wake_up``."""
        return tuple(t for t in WAKE_TAGS if t in self._awake)

    # ---------------------------------------------------------------- generation

    def generate(
        self,
        requests: list[GenerationRequest],
        sampling: SamplingParams,
        interrupt: Callable[[], bool] | None = None,
        abort_groups: Callable[[], frozenset[int]] | None = None,
        admit: Admit | None = None,
        on_result: OnResult | None = None,
    ) -> list[GenerationResult]:
        """Continue every request (prompt token ids), each up to its own budget
        (``GenerationRequest.budget``); results in request order. ``interrupt``: polled after
        each decode step; once True, every request still running ends with the tokens it has
        (finish reason ``interrupted``; those of batches not begun, with none).
        ``abort_groups``: polled likewise; the requests of the groups it names end there (as
        interrupted), the others go on. ``admit`` (``joinable``): polled likewise with the
        room left in the batch (requests), it returns requests that join the running batch
        (``rollout.engines.hf.steps``), numbered after the given ones in the order admitted;
        their results follow the given ones'. ``on_result(index, result)``: called as each
        request ends, before the call returns."""
        if len(self._awake) < len(WAKE_TAGS):
            raise RuntimeError(
                f"HFEngine.generate called while {self._sleeping()} asleep; call wake_up() first"
            )
        for i, req in enumerate(requests):
            self._check(req, sampling, f"requests[{i}]")
        results: list[GenerationResult | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        chunks = [
            order[start : start + self.max_batch_size]
            for start in range(0, len(order), self.max_batch_size)
        ] or [[]]
        joined: list[GenerationResult] = []
        for c, chunk in enumerate(chunks):
            last = c == len(chunks) - 1  # requests join the last batch of the call
            gone = abort_groups() if abort_groups is not None else frozenset()
            if interrupt is not None and interrupt():
                outs = [GenerationResult([], [], "interrupted") for _ in chunk]
                if on_result is not None:
                    for i, out in zip(chunk, outs):
                        on_result(i, out)
            else:
                todo = [i for i in chunk if requests[i].group not in gone]
                skipped = [i for i in chunk if requests[i].group in gone]
                if on_result is not None:
                    for i in skipped:
                        on_result(i, GenerationResult([], [], "interrupted"))

                def report(b: int, out: GenerationResult, todo=todo) -> None:
                    on_result(todo[b] if b < len(todo) else len(requests) + b - len(todo), out)

                def take(room: int) -> list[GenerationRequest]:
                    got = admit(room)
                    for k, req in enumerate(got):
                        self._check(req, sampling, f"admitted request {k}")
                    return got

                batch = DecodeBatch(
                    self,
                    sampling,
                    interrupt,
                    abort_groups,
                    take if admit is not None and last else None,
                    report if on_result is not None else None,
                )
                with self._lock:
                    done = batch.run([requests[i] for i in todo])
                by_index = dict(zip(todo, done))
                joined += done[len(todo) :]
                outs = [by_index.get(i) or GenerationResult([], [], "interrupted") for i in chunk]
            for i, out in zip(chunk, outs):
                results[i] = out
        return [*results, *joined]  # type: ignore[list-item]

    def _check(self, req: GenerationRequest, sampling: SamplingParams, name: str) -> None:
        """Raise, naming ``name``, when ``req`` cannot be generated by this model."""
        if len(req.prompt_ids) == 0:
            raise ValueError(f"{name}.prompt_ids is empty; give at least one token")
        limit = getattr(self.model.config, "max_position_embeddings", None)
        budget = req.budget(sampling)
        if limit is not None and len(req.prompt_ids) + budget > limit:
            raise ValueError(
                f"{name}: prompt of {len(req.prompt_ids)} tokens + max_new_tokens={budget} "
                f"exceeds the model's max_position_embeddings={limit}; shorten "
                "rollout.max_input_len or rollout.max_new_tokens"
            )

    def _prefill(self, prompts: list[list[int]]):
        """The prompts through the model: the last position's logits ``[prompts, vocab]``, the
        KV cache, the attention mask ``[prompts, width]`` and, when the engine returns a
        mixture's routing (``return_routes``), each prompt's routes (int16
        ``[len(prompt), MoE layers, top_k]``, expert id + 1), else None.

        The prompts' common head (a chat template's opening, a system prompt) goes through the
        model once when that saves at least ``_MIN_SHARED_HEAD_TOKENS`` tokens; the rest of each
        prompt follows it in one batched forward, left-padded, so a row's padding sits between
        the head and its rest (masked out, positions counted over real tokens only).
        """
        sink: list[torch.Tensor] = []
        with recording(sink) if self.return_routes else contextlib.nullcontext():
            logits, cache, attention_mask, head = self._prefill_forward(prompts)
        routes = (
            prompt_routes(sink, [len(p) for p in prompts], head) if self.return_routes else None
        )
        return logits, cache, attention_mask, routes

    def _prefill_forward(self, prompts: list[list[int]]):
        """``_prefill``'s forwards: logits, cache, mask and the shared head's length."""
        device = self._device
        head = len(os.path.commonprefix(prompts))
        head = min(head, min(len(p) for p in prompts) - 1)  # every prompt keeps a token
        cache = None
        if head * (len(prompts) - 1) >= _MIN_SHARED_HEAD_TOKENS:
            cache = _cache_of(
                self.model(
                    input_ids=torch.tensor([prompts[0][:head]], dtype=torch.long, device=device),
                    use_cache=True,
                    **self._last_logits_only,
                )
            )
            cache.batch_repeat_interleave(len(prompts))
        else:
            head = 0
        lens = [len(p) - head for p in prompts]
        width = max(lens)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), head + width), dtype=torch.long)
        attention_mask[:, :head] = 1
        for b, ids in enumerate(prompts):  # left padding: every row ends at the same column
            input_ids[b, width - lens[b] :] = torch.tensor(ids[head:], dtype=torch.long)
            attention_mask[b, head + width - lens[b] :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0)[:, head:],
            use_cache=True,
            **{self._cache_kw: cache},
            **self._last_logits_only,
        )
        return out.logits[:, -1, :], _cache_of(out), attention_mask, head

    # ---------------------------------------------------------------- weights and memory

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the model by HF state-dict name (one bucket or many calls)."""
        if "weights" not in self._awake:
            raise RuntimeError(
                "HFEngine.update_weights called while the weights sleep; call "
                "wake_up(['weights']) first"
            )
        state = self.model.state_dict()
        for name, tensor in named_tensors:
            if name not in state:
                raise ValueError(
                    f"update_weights got unknown parameter {name!r}; names must be the model's "
                    f"state-dict names (e.g. {next(iter(state))!r})"
                )
            target = state[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model "
                    f"expects {tuple(target.shape)}"
                )
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))

    def receive_weights(self, update_info: dict) -> int:
        """Take one whole push from the transfer group (``Engine.receive_weights``); a pushed
        name the model does not have is received with the rest (the sender's broadcast runs
        to its end) and then raised, every such name in one line
        (``rollout.engines.weights.loaded_names.unloaded_error``). Returns the tensor count."""
        from rollout.engines.weights.loaded_names import unloaded_error
        from rollout.engines.weights.transfer import TransferUpdateInfo

        known = set(self.model.state_dict())
        missing = [name for name in update_info["names"] if name not in known]

        def load(named) -> None:
            self.update_weights((name, t) for name, t in named if name in known)

        count = self._receiver.receive(TransferUpdateInfo(**update_info), load)
        self.finish_weight_update()
        if missing:
            raise unloaded_error(missing, count, "HFEngine")
        return count

    def _sleeping(self) -> str:
        return " and ".join(t for t in WAKE_TAGS if t not in self._awake)

    def sleep(self, discard_weights: bool = False) -> None:
        """Free the device for the trainer: the weights move to host memory and the
        KV cache memory and the allocator's cache are released. On the CPU the weights and
        the KV memory stay where they are (memory the next rollout would touch afresh); the
        state is recorded either way (``awake_tags``). ``discard_weights`` is accepted and
        changes nothing here: this development engine keeps its weights (host memory)."""
        if "weights" in self._awake and self._device.type != "cpu":
            self.model.to("cpu")
        if self._device.type != "cpu":
            self._arena.release()
            if torch.accelerator.is_available():
                torch.accelerator.empty_cache()
        self._awake.clear()

    def wake_up(self, tags=None) -> None:
        """Retake ``tags`` (``WAKE_TAGS``; None: all): ``weights`` moves the model back to its
        device; ``kv_cache`` only re-allows generation (the next call allocates the KV cache
        memory that ``sleep`` released)."""
        tags = WAKE_TAGS if tags is None else tuple(tags)
        unknown = [t for t in tags if t not in WAKE_TAGS]
        if unknown:
            raise ValueError(f"wake_up tags={unknown}: use some of {list(WAKE_TAGS)}")
        if "weights" in tags and "weights" not in self._awake and self._device.type != "cpu":
            self.model.to(self._device)
        self._awake.update(tags)

    def shutdown(self) -> None:
        """Drop the model reference."""
        self.model = None  # type: ignore[assignment]


def _cache_of(out) -> object:
    """The KV cache a forward returned: ``out.cache`` (transformers 5.2x) or, before,
    ``out.past_key_values``."""
    return out["cache"] if "cache" in out else out["past_key_values"]
