"""HF transformers engine: batched sampling with our own loop on any torch device.

Why our own loop rather than ``model.generate``: every request samples from its own
``torch.Generator`` seeded from ``GenerationRequest.seed``, so what a request samples does not
depend on which requests share its batch (up to float effects of padding), and the logprob of
each sampled token is ``log_softmax(logits / temperature)`` before top-p/top-k filtering, exactly
the distribution the trainer evaluates.

The uniform numbers behind each draw come from a CPU generator and the draw is an inverse-CDF
lookup, so the sampler's random stream is the same on every device type.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rollout.engines.base import (
    WAKE_TAGS,
    Engine,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)


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
        self._awake: set[str] = set(WAKE_TAGS)

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
        self, requests: list[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """Continue every request (prompt token ids); results in request order."""
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
            if limit is not None and longest + sampling.max_new_tokens > limit:
                raise ValueError(
                    f"prompt of {longest} tokens + max_new_tokens={sampling.max_new_tokens} "
                    f"exceeds the model's max_position_embeddings={limit}; shorten "
                    "rollout.max_input_len or rollout.max_new_tokens"
                )
            outs = self._generate_batch([requests[i] for i in chunk], sampling)
            for i, out in zip(chunk, outs):
                results[i] = out
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _generate_batch(
        self, requests: list[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        device = self._device
        bsz = len(requests)
        lens = [len(r.prompt_ids) for r in requests]
        width = max(lens)
        input_ids = torch.full((bsz, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((bsz, width), dtype=torch.long)
        for b, req in enumerate(requests):  # left padding: every row ends at the same column
            input_ids[b, width - lens[b] :] = torch.tensor(req.prompt_ids, dtype=torch.long)
            attention_mask[b, width - lens[b] :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        generators = [torch.Generator(device="cpu").manual_seed(int(r.seed)) for r in requests]
        stop_ids = set(sampling.stop_token_ids)

        tokens: list[list[int]] = [[] for _ in range(bsz)]
        logprobs: list[list[float]] = [[] for _ in range(bsz)]
        finished = [False] * bsz
        stopped = [False] * bsz
        past = None
        next_pos = position_ids[:, -1:] + 1
        step_ids, step_pos = input_ids, position_ids
        for _ in range(sampling.max_new_tokens):
            out = self.model(
                input_ids=step_ids,
                attention_mask=attention_mask,
                position_ids=step_pos,
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            scaled = out.logits[:, -1, :].float() / sampling.temperature
            logp = torch.log_softmax(scaled, dim=-1)
            probs = torch.softmax(filter_logits(scaled, sampling.top_k, sampling.top_p), dim=-1)
            # One uniform per live request from its own generator: a request's random stream
            # advances only with its own tokens, whatever else is in the batch.
            uniforms = torch.tensor(
                [
                    torch.rand((), generator=g).item() if not done else 0.0
                    for g, done in zip(generators, finished)
                ],
                dtype=torch.float64,
            )
            chosen = sample_inverse_cdf(probs, uniforms.to(device))
            chosen_logp = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).tolist()
            chosen_ids = chosen.tolist()
            for b in range(bsz):
                if finished[b]:
                    continue
                tok = chosen_ids[b]
                tokens[b].append(tok)
                logprobs[b].append(chosen_logp[b])
                if tok in stop_ids:
                    finished[b] = stopped[b] = True
            if all(finished):
                break
            # Finished rows keep feeding their last token; their outputs are ignored.
            step_ids = torch.tensor(
                [row[-1] for row in tokens], dtype=torch.long, device=device
            ).unsqueeze(-1)
            step_pos = next_pos
            next_pos = next_pos + 1
            attention_mask = torch.cat(
                [attention_mask, torch.ones((bsz, 1), dtype=attention_mask.dtype, device=device)],
                dim=-1,
            )
        return [
            GenerationResult(
                token_ids=tokens[b],
                logprobs=logprobs[b],
                finish_reason="stop" if stopped[b] else "length",
            )
            for b in range(bsz)
        ]

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

    def _sleeping(self) -> str:
        return " and ".join(t for t in WAKE_TAGS if t not in self._awake)

    def sleep(self) -> None:
        """Free the device for the trainer: the weights move to host memory and the
        allocator's cache (what generation's KV cache used) is released. On the CPU the
        weights stay where they are; the state is recorded either way (``awake_tags``)."""
        if "weights" in self._awake and self._device.type != "cpu":
            self.model.to("cpu")
        if self._device.type != "cpu" and torch.accelerator.is_available():
            torch.accelerator.empty_cache()
        self._awake.clear()

    def wake_up(self, tags=None) -> None:
        """Retake ``tags`` (``WAKE_TAGS``; None: all): ``weights`` moves the model back to its
        device; ``kv_cache`` only re-allows generation (this engine allocates its cache per
        call)."""
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
