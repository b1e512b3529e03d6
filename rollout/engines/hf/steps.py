"""The HF engine's decode loop (``rollout.engines.hf.engine.HFEngine``): one batch of rows on a
KV cache, sampling one token per row per step, in which requests join between decode steps
and leave when done.

A row is one request. Its i-th token is drawn with the i-th uniform of its own generator
(seeded from ``GenerationRequest.seed``), so what it samples does not depend on the rows beside
it or on the step at which it joined (beyond float effects of the batch's shape). A row ends on
a stop token, at its own budget (``GenerationRequest.budget``), when its group is aborted, or
when the call is interrupted; ``on_result`` hears of each request as soon as it ends.

Joining (``admit``): between two decode steps the loop asks ``admit(room)`` for at most
``room`` more requests; they are prefilled (each distinct prompt once) and joined to the batch:
the cache is laid out anew with every row right-aligned at one column (left padding masked
out, the columns no row uses any more dropped), the rows that ended leave it, and the buffers
are sized for what every row has left (``rollout.engines.hf.kv_buffer.join_rows``). A call with
``admit`` thus runs for as long as it has rows; it ends once none is left and none joins.
Without ``admit`` the loop is the engine's plain batched call, its floats unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch

from rollout.engines.base import (
    Admit,
    GenerationRequest,
    GenerationResult,
    OnResult,
    SamplingParams,
)
from rollout.engines.hf.kv_buffer import BufferLayer, join_rows, share_prefill
from rollout.engines.hf.sampler import filter_logits, sample_inverse_cdf
from rollout.moe_routing import recording, step_routes

#: Finished rows leave the decode batch once they are 1/_COMPACT_FRACTION of its rows: dropping
#: them copies the cache, so it waits until it saves a sizeable share of every later step.
_COMPACT_FRACTION = 8


class DecodeBatch:
    """The rows of one engine call on ``engine`` (an ``HFEngine``: its model, prefill and KV
    arena) under ``sampling``. ``run`` decodes; request ``b`` is the b-th request given or
    admitted, in order."""

    def __init__(
        self,
        engine,
        sampling: SamplingParams,
        interrupt: Callable[[], bool] | None = None,
        abort_groups: Callable[[], frozenset[int]] | None = None,
        admit: Admit | None = None,
        on_result: OnResult | None = None,
    ) -> None:
        self.engine, self.sampling = engine, sampling
        self.interrupt, self.abort_groups = interrupt, abort_groups
        self.admit, self.on_result = admit, on_result
        self.stop_ids = set(sampling.stop_token_ids)
        self.requests: list[GenerationRequest] = []
        self.budgets: list[int] = []
        self.tokens: list[list[int]] = []
        self.logprobs: list[list[float]] = []
        self.stopped: list[bool] = []
        self.ended: list[bool] = []  # stopped, its budget reached, or its group aborted
        self.cut: list[bool] = []  # ended by an abort of its group or an interrupt
        self.sent: list[bool] = []  # handed to on_result
        self.draw_of: list[torch.Tensor] = []  # each request's uniforms, one per token
        self.routes: list[list[np.ndarray]] = []  # a mixture's routing per request, in pieces

    # ---------------------------------------------------------------- requests

    def _add(self, requests: list[GenerationRequest]) -> list[int]:
        first = len(self.requests)
        for r in requests:
            budget = r.budget(self.sampling)
            self.requests.append(r)
            self.budgets.append(budget)
            self.tokens.append([])
            self.logprobs.append([])
            self.stopped.append(False)
            self.ended.append(False)
            self.cut.append(False)
            self.sent.append(False)
            self.routes.append([])
            # All of a request's uniforms come from one call (the same numbers as one call per
            # token); a prefix of torch.rand's stream does not depend on the count drawn.
            self.draw_of.append(
                torch.rand(budget, generator=torch.Generator(device="cpu").manual_seed(int(r.seed)))
            )
        return list(range(first, len(self.requests)))

    def _draws(self, rows: list[int], width: int) -> torch.Tensor:
        draws = torch.zeros((len(rows), width), dtype=torch.float64)
        for row, b in enumerate(rows):
            draws[row, : self.budgets[b]] = self.draw_of[b]
        return draws.to(self.engine.device)

    def result(self, b: int) -> GenerationResult:
        """Request ``b``'s result as it stands."""
        reason = "stop" if self.stopped[b] else ("interrupted" if self.cut[b] else "length")
        out = GenerationResult(self.tokens[b], self.logprobs[b], reason)
        if self.routes[b]:  # every token fed: the prompt's and each sampled one but the last
            out.extra["routed_experts"] = np.concatenate(self.routes[b])
        return out

    def _deliver(self, rows: list[int]) -> None:
        if self.on_result is None:
            return
        for b in rows:
            if self.ended[b] and not self.sent[b]:
                self.sent[b] = True
                self.on_result(b, self.result(b))

    # ---------------------------------------------------------------- layout

    def _start(self, rows: list[int]) -> None:
        """A fresh batch of ``rows`` (request indices): each distinct prompt prefilled once and
        its cache and last logits copied to the rows that continue it."""
        device = self.engine.device
        distinct: dict[tuple[int, ...], int] = {}
        source_ids = [
            distinct.setdefault(tuple(self.requests[b].prompt_ids), len(distinct)) for b in rows
        ]
        logits, cache, prompt_mask, routes = self.engine._prefill([list(p) for p in distinct])
        self._take_prompt_routes(rows, source_ids, routes)
        width = prompt_mask.shape[-1]
        source = torch.tensor(source_ids, dtype=torch.long, device=device)
        steps = max(self.budgets[b] for b in rows)
        # The last sampled token is never fed back: the cache holds width + max_new - 1 tokens.
        capacity = width + steps - 1
        self.cache = share_prefill(cache, source, capacity, self.engine._arena)
        self.logits = logits.index_select(0, source)
        self.mask = torch.ones((len(rows), capacity), dtype=torch.long, device=device)
        self.mask[:, :width] = prompt_mask.index_select(0, source)
        self.next_pos = self.mask[:, :width].sum(-1, keepdim=True)  # position of the next token
        self.filled = width  # cache columns written
        self.draws = self._draws(rows, steps)
        self.live = list(rows)  # the request of each batch row

    def _take_prompt_routes(self, rows: list[int], source_ids: list[int], routes) -> None:
        if routes is not None:
            for b, source in zip(rows, source_ids, strict=True):
                self.routes[b] = [routes[source]]

    def _joinable(self) -> bool:
        return all(isinstance(layer, BufferLayer) for layer in self.cache.layers)

    def _join(self, keep: list[int], joined: list[int]) -> None:
        """The batch laid out anew: rows ``keep`` (batch rows, ascending) stay, the requests
        ``joined`` are prefilled and added after them."""
        device = self.engine.device
        distinct: dict[tuple[int, ...], int] = {}
        source_ids = [
            distinct.setdefault(tuple(self.requests[b].prompt_ids), len(distinct)) for b in joined
        ]
        logits, cache, prompt_mask, routes = self.engine._prefill([list(p) for p in distinct])
        self._take_prompt_routes(joined, source_ids, routes)
        source = torch.tensor(source_ids, dtype=torch.long, device=device)
        kept = torch.tensor(keep, dtype=torch.long, device=device)
        old = self.mask[:, : self.filled].index_select(0, kept)
        # Columns before every kept row's first attended one are padding for all: dropped.
        lead = int(torch.argmax((old > 0).to(torch.int8), dim=-1).min()) if keep else 0
        old = old[:, lead:]
        new = prompt_mask.index_select(0, source)
        width = max(old.shape[-1], new.shape[-1])
        rows = [self.live[row] for row in keep] + joined
        left = [self.budgets[b] - len(self.tokens[b]) for b in rows]
        capacity = width + max(left) - 1
        self.cache = join_rows(
            self.cache, kept, lead, self.filled, cache, source, width, capacity, self.engine._arena
        )
        mask = torch.ones((len(rows), capacity), dtype=torch.long, device=device)
        mask[: len(keep), :width] = 0
        mask[: len(keep), width - old.shape[-1] : width] = old
        mask[len(keep) :, :width] = 0
        mask[len(keep) :, width - new.shape[-1] : width] = new
        self.next_pos = torch.cat([self.next_pos.index_select(0, kept), new.sum(-1, keepdim=True)])
        self.logits = torch.cat([self.logits.index_select(0, kept), logits.index_select(0, source)])
        self.mask, self.filled = mask, width
        self.draws = self._draws(rows, max(self.budgets[b] for b in rows))
        self.live = rows

    def _compact(self, keep: list[int]) -> None:
        rows = torch.tensor(keep, dtype=torch.long, device=self.engine.device)
        self.cache.batch_select_indices(rows)
        self.mask = self.mask.index_select(0, rows)
        self.next_pos = self.next_pos.index_select(0, rows)
        self.draws = self.draws.index_select(0, rows)
        self.live = [self.live[row] for row in keep]

    # ---------------------------------------------------------------- the loop

    def _sample(self) -> None:
        """One token for every row from the current logits; ends the rows that are done."""
        sampling = self.sampling
        scaled = self.logits.float() / sampling.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        probs = torch.softmax(filter_logits(scaled, sampling.top_k, sampling.top_p), dim=-1)
        at = torch.tensor(
            [min(len(self.tokens[b]), self.budgets[b] - 1) for b in self.live],
            dtype=torch.long,
            device=self.draws.device,
        )
        chosen = sample_inverse_cdf(probs, self.draws.gather(1, at.unsqueeze(-1)).squeeze(-1))
        chosen_logp = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).tolist()
        chosen_ids = chosen.tolist()
        for row, b in enumerate(self.live):
            if self.ended[b]:
                continue
            self.tokens[b].append(chosen_ids[row])
            self.logprobs[b].append(chosen_logp[row])
            self.stopped[b] = chosen_ids[row] in self.stop_ids
            self.ended[b] = self.stopped[b] or len(self.tokens[b]) >= self.budgets[b]

    def _forward(self) -> None:
        engine = self.engine
        step_ids = torch.tensor(
            [self.tokens[b][-1] for b in self.live], dtype=torch.long, device=engine.device
        ).unsqueeze(-1)
        sink: list[torch.Tensor] = []
        with recording(sink) if engine.return_routes else contextlib.nullcontext():
            out = engine.model(
                input_ids=step_ids,
                attention_mask=self.mask[:, : self.filled + 1],
                position_ids=self.next_pos,
                use_cache=True,
                **{engine._cache_kw: self.cache},
                **engine._last_logits_only,
            )
        if sink:  # the fed token's routing, for the rows still running (an ended row's is not)
            routes = step_routes(sink, len(self.live))
            for row, b in enumerate(self.live):
                if not self.ended[b]:
                    self.routes[b].append(routes[row])
        self.logits = out.logits[:, -1, :]
        self.next_pos = self.next_pos + 1
        self.filled += 1

    def _admitted(self, room: int) -> list[int]:
        if self.admit is None or room <= 0:
            return []
        return self._add(self.admit(room))

    @torch.no_grad()
    def run(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Decode ``requests`` and every request admitted meanwhile; results in request order
        (those given, then those admitted)."""
        rows = self._add(requests)
        if not rows:
            return []
        self._start(rows)
        admit = self.admit is not None and self._joinable()
        joined: list[int] = []
        while True:
            if joined:
                keep = [row for row, b in enumerate(self.live) if not self.ended[b]]
                if keep:
                    self._join(keep, joined)
                else:  # nothing left to keep: a fresh batch, as a call of their own
                    self._start(joined)
                joined = []
            self._sample()
            if self.abort_groups is not None and any(not self.ended[b] for b in self.live):
                gone = self.abort_groups()
                for b in self.live:
                    if not self.ended[b] and self.requests[b].group in gone:
                        self.ended[b] = self.cut[b] = True  # its group's rows end; the rest go on
            self._deliver(self.live)
            keep = [row for row, b in enumerate(self.live) if not self.ended[b]]
            if keep and self.interrupt is not None and self.interrupt():
                for b in self.live:  # the rows still running end here
                    self.cut[b] = self.cut[b] or not self.ended[b]
                break
            if admit:  # the call goes on: requests waiting join it
                joined = self._admitted(self.engine.max_batch_size - len(keep))
            if not keep:
                if joined:
                    continue
                break
            # Finished rows keep feeding their last token (outputs ignored) until they are an
            # eighth of the batch; then they leave it, and the cache rows go with them.
            if not joined and (len(self.live) - len(keep)) * _COMPACT_FRACTION >= len(self.live):
                self._compact(keep)
            self._forward()
        self._deliver(list(range(len(self.requests))))
        return [self.result(b) for b in range(len(self.requests))]
