"""``VLLMEngine.generate`` one engine step at a time (``Steps``), for calls that are
interrupted, have groups aborted, take requests into the running batch, or report each
request as it ends (the engine server's calls, ``rollout.engines.serving.server``); and a vLLM
completion as a ``GenerationResult`` (``vllm_result``). vLLM is never imported here."""

from __future__ import annotations

from typing import Any

from rollout.engines.base import GenerationResult
from rollout.engines.vllm.io import result_from_vllm_completion

__all__ = ["Steps", "vllm_result"]


def vllm_result(
    completion, ended: bool, renormalized: bool, moe_layers: list[int] | None = None
) -> GenerationResult:
    """A request's ``GenerationResult`` from its latest ``CompletionOutput`` (None: it never
    ran); ``ended``: cut by an interrupt or an abort; ``moe_layers``: the engine returns a
    mixture's routing (``VLLMEngine.moe_layers``)."""
    if completion is None:  # interrupted before it was scheduled
        result = GenerationResult([], [], "interrupted")
    else:
        result = result_from_vllm_completion(completion, interrupted=ended, moe_layers=moe_layers)
    if renormalized:
        result.extra["logprobs_renormalized"] = True
    return result


class Steps:
    """One ``VLLMEngine.generate`` call driven one engine step at a time (what ``LLM.generate``
    does, through vLLM's ``LLMEngine.add_request`` / ``step`` / ``abort_request``, alike in
    0.24 and 0.32), with ``interrupt``, ``abort_groups`` and ``admit`` polled after each step:
    all requests still running are aborted by id once ``interrupt`` says so, those of the
    groups ``abort_groups`` names as soon as it does (their KV blocks freed, the rest goes on),
    and the requests ``admit`` returns are added to vLLM's running batch. ``on_result`` hears
    of each request as it ends."""

    def __init__(self, owner, sampling, renormalized, interrupt, abort_groups, admit, on_result):
        self.owner, self.sampling, self.renormalized = owner, sampling, renormalized
        self.interrupt, self.abort_groups = interrupt, abort_groups
        self.admit, self.on_result = admit, on_result
        self.ids: list[str] = []
        self.group_of: dict[str, int] = {}
        self.latest: dict[str, Any] = {}
        self.cut: set[str] = set()
        self.reported: set[str] = set()

    def _add(self, prompts: list[dict], params: list, groups: list[int]) -> None:
        from vllm.sampling_params import RequestOutputKind

        engine = self.owner.llm.llm_engine
        for prompt, param, group in zip(prompts, params, groups):
            param.output_kind = RequestOutputKind.CUMULATIVE  # the tokens so far, every step
            request_id = f"crossrl-{next(self.owner._request_ids)}"
            self.ids.append(request_id)
            self.group_of[request_id] = group
            engine.add_request(request_id, prompt, param, lora_request=self.owner._lora_request)

    def _report(self) -> None:
        if self.on_result is None:
            return
        for index, request_id in enumerate(self.ids):
            if request_id in self.reported:
                continue
            out = self.latest.get(request_id)
            if request_id in self.cut or (out is not None and out.finished):
                self.reported.add(request_id)
                completion = None if out is None else out.outputs[0]
                cut = request_id in self.cut
                self.on_result(
                    index, vllm_result(completion, cut, self.renormalized, self.owner.moe_layers)
                )

    def _admitted(self, running: int) -> bool:
        """Add what ``admit`` returns for the room left (``running`` requests in the batch);
        whether any request joined."""
        if self.admit is None:
            return False
        joining = self.admit(max(0, self.owner.max_batch_size - running))
        if joining:
            prompts, params = self.owner._prepare(joining, self.sampling, "admitted")
            self._add(prompts, params, [req.group for req in joining])
        return bool(joining)

    def run(self, prompts: list[dict], params: list, groups: list[int]) -> list[GenerationResult]:
        """Every request's result, in order (those given, then those admitted)."""
        engine = self.owner.llm.llm_engine
        self._add(prompts, params, groups)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id in self.group_of:
                    self.latest[out.request_id] = out
            running = [
                r
                for r in self.ids
                if r not in self.cut and (r not in self.latest or not self.latest[r].finished)
            ]
            if running and self.interrupt is not None and self.interrupt():
                engine.abort_request(running)
                self.cut.update(running)
                break
            gone = self.abort_groups() if self.abort_groups is not None and running else ()
            dropped = [r for r in running if self.group_of[r] in gone]
            if dropped:  # only these leave; the call goes on with the others
                engine.abort_request(dropped)
                self.cut.update(dropped)
            self._report()
            before = len(self.ids)
            self._admitted(len(running) - len(dropped))
            if len(running) == len(dropped) and len(self.ids) == before:
                break  # every request ended or was aborted, and none joins
        self._report()
        return [
            vllm_result(
                self.latest[r].outputs[0] if r in self.latest else None,
                r in self.cut,
                self.renormalized,
                self.owner.moe_layers,
            )
            for r in self.ids
        ]
