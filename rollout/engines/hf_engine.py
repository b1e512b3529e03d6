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
(``rollout/engines/kv_buffer.py``) instead of growing by ``torch.cat`` each step; rows that
sampled a stop token leave the batch once they are an eighth of it; only the last position's
logits are computed. A request's tokens and logprobs do not depend on which of these paths it
took, beyond float effects of the batch's shape.
"""

from __future__ import annotations

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
from rollout.engines.kv_buffer import KVArena, share_prefill

#: Finished rows leave the decode batch once they are 1/_COMPACT_FRACTION of its rows: dropping
#: them copies the cache, so it waits until it saves a sizeable share of every later step.
_COMPACT_FRACTION = 8

#: The distinct prompts' common head is prefilled once (one extra forward) when that saves at
#: least this many prompt tokens: below it, the extra call costs about what it saves.
_MIN_SHARED_HEAD_TOKENS = 256


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k and outside the top-p nucleus; ``[B, V]`` logits.

    ``top_k = 0`` and ``top_p = 1.0`` switch the filters off. The most likely token always stays.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass of the tokens strictly before it already reaches top_p.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample one token per row of ``probs`` ``[B, V]`` from uniforms ``[B]`` in [0, 1).

    Tokens with probability 0 are never chosen.
    """
    cdf = probs.cumsum(dim=-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # Float rounding can put the target at the very end: fall back to the last allowed token.
    last_allowed = probs.shape[-1] - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.minimum(idx, last_allowed)


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

    interruptible = True  # ``interrupt`` is polled after every decode step
    abortable = True  # ``abort_groups`` too: one group's requests end, the others go on

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
    ) -> list[GenerationResult]:
        """Continue every request (prompt token ids), each up to its own budget
        (``GenerationRequest.budget``); results in request order. ``interrupt``: polled after
        each decode step; once True, every request still running ends with the tokens it has
        (finish reason ``interrupted``; those of batches not begun, with none).
        ``abort_groups``: polled likewise; the requests of the groups it names end there (as
        interrupted), the others go on."""
        if len(self._awake) < len(WAKE_TAGS):
            raise RuntimeError(
                f"HFEngine.generate called while {self._sleeping()} asleep; call wake_up() first"
            )
        for i, req in enumerate(requests):
            if len(req.prompt_ids) == 0:
                raise ValueError(f"requests[{i}].prompt_ids is empty; give at least one token")
        limit = getattr(self.model.config, "max_position_embeddings", None)
        results: list[GenerationResult | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start : start + self.max_batch_size]
            longest = max(len(requests[i].prompt_ids) for i in chunk)
            budget = max(requests[i].budget(sampling) for i in chunk)
            if limit is not None and longest + budget > limit:
                raise ValueError(
                    f"prompt of {longest} tokens + max_new_tokens={budget} "
                    f"exceeds the model's max_position_embeddings={limit}; shorten "
                    "rollout.max_input_len or rollout.max_new_tokens"
                )
            gone = abort_groups() if abort_groups is not None else frozenset()
            if interrupt is not None and interrupt():
                outs = [GenerationResult([], [], "interrupted") for _ in chunk]
            else:
                todo = [i for i in chunk if requests[i].group not in gone]
                with self._lock:
                    done = self._generate_batch(
                        [requests[i] for i in todo], sampling, interrupt, abort_groups
                    )
                by_index = dict(zip(todo, done))
                outs = [by_index.get(i) or GenerationResult([], [], "interrupted") for i in chunk]
            for i, out in zip(chunk, outs):
                results[i] = out
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _generate_batch(
        self,
        requests: list[GenerationRequest],
        sampling: SamplingParams,
        interrupt: Callable[[], bool] | None = None,
        abort_groups: Callable[[], frozenset[int]] | None = None,
    ) -> list[GenerationResult]:
        device = self._device
        bsz = len(requests)
        if not bsz:
            return []
        budgets = [r.budget(sampling) for r in requests]
        steps = max(budgets)
        # Prefix sharing: the samples of a prompt carry the same ids; each distinct prompt is
        # prefilled once and its cache and last logits are copied to the rows that continue it.
        distinct: dict[tuple[int, ...], int] = {}
        source_ids = [distinct.setdefault(tuple(r.prompt_ids), len(distinct)) for r in requests]
        logits, cache, prompt_mask = self._prefill([list(p) for p in distinct])
        width = prompt_mask.shape[-1]
        source = torch.tensor(source_ids, dtype=torch.long, device=device)
        # The last sampled token is never fed back: the cache holds width + max_new - 1 tokens.
        capacity = width + steps - 1
        cache = share_prefill(cache, source, capacity, self._arena)
        logits = logits.index_select(0, source)
        attention_mask = torch.ones((bsz, capacity), dtype=torch.long, device=device)
        attention_mask[:, :width] = prompt_mask.index_select(0, source)
        next_pos = attention_mask[:, :width].sum(-1, keepdim=True)  # position of the next token
        # Request b's i-th token is drawn with the i-th uniform of its own generator: its random
        # stream advances only with its own tokens, whatever else is in the batch. All of a
        # request's uniforms come from one call (the same numbers as one call per token).
        draws = torch.stack(
            [
                torch.rand(
                    steps,
                    generator=torch.Generator(device="cpu").manual_seed(int(r.seed)),
                )
                for r in requests
            ]
        ).to(device=device, dtype=torch.float64)
        stop_ids = set(sampling.stop_token_ids)

        tokens: list[list[int]] = [[] for _ in range(bsz)]
        logprobs: list[list[float]] = [[] for _ in range(bsz)]
        stopped = [False] * bsz
        ended = [False] * bsz  # stopped, its budget reached, or its group aborted
        cut = [False] * bsz  # ended by an abort of its group or an interrupt
        live = list(range(bsz))  # the request of each batch row
        for step in range(steps):
            scaled = logits.float() / sampling.temperature
            logp = torch.log_softmax(scaled, dim=-1)
            probs = torch.softmax(filter_logits(scaled, sampling.top_k, sampling.top_p), dim=-1)
            chosen = sample_inverse_cdf(probs, draws[:, step])
            chosen_logp = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).tolist()
            chosen_ids = chosen.tolist()
            for row, b in enumerate(live):
                if ended[b]:
                    continue
                tokens[b].append(chosen_ids[row])
                logprobs[b].append(chosen_logp[row])
                stopped[b] = chosen_ids[row] in stop_ids
                ended[b] = stopped[b] or len(tokens[b]) >= budgets[b]
            if abort_groups is not None and any(not ended[b] for b in live):
                gone = abort_groups()
                for b in live:
                    if not ended[b] and requests[b].group in gone:
                        ended[b] = cut[b] = True  # its group's rows end; the rest go on
            keep = [row for row, b in enumerate(live) if not ended[b]]
            if not keep or step == steps - 1:
                break
            if interrupt is not None and interrupt():
                for b in live:  # the rows still running end here
                    cut[b] = cut[b] or not ended[b]
                break
            # Finished rows keep feeding their last token (outputs ignored) until they are an
            # eighth of the batch; then they leave it, and the cache rows go with them.
            if (len(live) - len(keep)) * _COMPACT_FRACTION >= len(live):
                rows = torch.tensor(keep, dtype=torch.long, device=device)
                cache.batch_select_indices(rows)
                attention_mask = attention_mask.index_select(0, rows)
                next_pos = next_pos.index_select(0, rows)
                draws = draws.index_select(0, rows)
                live = [live[row] for row in keep]
            step_ids = torch.tensor(
                [tokens[b][-1] for b in live], dtype=torch.long, device=device
            ).unsqueeze(-1)
            out = self.model(
                input_ids=step_ids,
                attention_mask=attention_mask[:, : width + step + 1],
                position_ids=next_pos,
                use_cache=True,
                **{self._cache_kw: cache},
                **self._last_logits_only,
            )
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1
        return [
            GenerationResult(
                token_ids=tokens[b],
                logprobs=logprobs[b],
                finish_reason="stop" if stopped[b] else ("interrupted" if cut[b] else "length"),
            )
            for b in range(bsz)
        ]

    def _prefill(self, prompts: list[list[int]]):
        """The prompts through the model: the last position's logits ``[prompts, vocab]``, the
        KV cache and the attention mask ``[prompts, width]``.

        The prompts' common head (a chat template's opening, a system prompt) goes through the
        model once when that saves at least ``_MIN_SHARED_HEAD_TOKENS`` tokens; the rest of each
        prompt follows it in one batched forward, left-padded, so a row's padding sits between
        the head and its rest (masked out, positions counted over real tokens only).
        """
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
        return out.logits[:, -1, :], _cache_of(out), attention_mask

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
        (``rollout.engines.loaded_names.unloaded_error``). Returns the tensor count."""
        from rollout.engines.loaded_names import unloaded_error
        from rollout.engines.transfer import TransferUpdateInfo

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
