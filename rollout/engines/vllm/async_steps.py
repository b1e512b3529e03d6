"""``VLLMEngine.generate`` through ``AsyncLLM`` (``AsyncSteps``): the contract of
``rollout.engines.vllm.steps.Steps`` (interrupt, abort by group, requests joining, each
reported as it ends), kept while vLLM's own engine loop runs in its process.

Each request is one ``AsyncLLM.generate`` stream on the handle's loop, its outputs relayed to
the calling thread (the engine server's) as they come; between two batches of outputs (at
most ``POLL_S`` apart) the call polls what its caller asks: once ``interrupt`` says so every
request still running is aborted by id; the requests of the groups ``abort_groups`` names
are aborted alone; what ``admit`` returns is added to the engine at once (vLLM's scheduler
takes it at its next step). Outputs come as deltas (``RequestOutputKind.DELTA``: each
carries the tokens sampled since the last one vLLM handed over, merged when the caller falls
behind), gathered per request (``Sampled``). A request's tokens are the ones its outputs have
carried so far: tokens vLLM sampled after that and before the abort reached it are dropped
with the request, so a continuation goes on from exactly what the caller was told. vLLM is
never imported here.
"""

from __future__ import annotations

import queue

from rollout.engines.base import GenerationResult
from rollout.engines.vllm.steps import Steps, vllm_result

__all__ = ["POLL_S", "AsyncSteps", "Sampled"]

#: Seconds the call waits for outputs before it polls its caller's interrupt, aborts and
#: joiners anyway (outputs arrive once per engine step while requests run).
POLL_S = 0.005


class Sampled:
    """What one request's delta outputs carried, gathered: a ``CompletionOutput`` as
    ``result_from_vllm_completion`` reads one (``token_ids``, ``logprobs``, ``finish_reason``,
    ``stop_reason``, ``routed_experts``), and ``finished``."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.finished = False
        self.routed_experts = None  # a mixture's routing, on the finishing output only

    def add(self, output) -> None:
        """One ``RequestOutput`` (delta) of this request. An output with no new tokens (the
        last one of an aborted or finished request) may carry the whole log-prob list: only
        as many entries as it has new tokens are taken, from its end."""
        completion = output.outputs[0]
        new = len(completion.token_ids)
        if new:
            self.token_ids += completion.token_ids
            self.logprobs += completion.logprobs[len(completion.logprobs) - new :]
        self.finish_reason = completion.finish_reason
        self.stop_reason = completion.stop_reason
        self.finished = bool(output.finished)
        if getattr(completion, "routed_experts", None) is not None:
            self.routed_experts = completion.routed_experts


class AsyncSteps(Steps):
    """One ``VLLMEngine.generate`` call over ``owner.llm`` (an ``AsyncLLMHandle``); arguments
    as ``Steps``'s, whose admission (``_admitted``) it shares."""

    def __init__(self, owner, sampling, renormalized, interrupt, abort_groups, admit, on_result):
        super().__init__(owner, sampling, renormalized, interrupt, abort_groups, admit, on_result)
        self.handle = owner.llm
        self.latest: dict[str, Sampled] = {}
        self.events: queue.SimpleQueue = queue.SimpleQueue()

    async def _stream(self, request_id: str, prompt: dict, param) -> None:
        """Relay ``request_id``'s outputs (or its error) to the calling thread."""
        try:
            stream = self.handle.generate(prompt, param, request_id, self.owner._lora_request)
            async for out in stream:
                self.events.put((request_id, out, None))
        except BaseException as exc:  # noqa: BLE001 - raised on the calling thread
            self.events.put((request_id, None, exc))

    def _add(self, prompts: list[dict], params: list, groups: list[int]) -> None:
        from vllm.sampling_params import RequestOutputKind

        for prompt, param, group in zip(prompts, params, groups):
            param.output_kind = RequestOutputKind.DELTA  # the tokens since the last output
            request_id = f"crossrl-{next(self.owner._request_ids)}"
            self.ids.append(request_id)
            self.latest[request_id] = Sampled()
            self.group_of[request_id] = group
            self.handle.start(self._stream(request_id, prompt, param))

    def _running(self) -> list[str]:
        return [r for r in self.ids if r not in self.cut and not self.latest[r].finished]

    def _take_outputs(self, wait: bool) -> None:
        """The outputs relayed so far (waiting up to ``POLL_S`` for the first, if ``wait``);
        a request's error ends the call."""
        events = []
        try:
            events.append(self.events.get(timeout=POLL_S) if wait else self.events.get_nowait())
            while True:
                events.append(self.events.get_nowait())
        except queue.Empty:
            pass
        for request_id, out, error in events:
            if request_id in self.cut:
                continue  # its last output after the abort: the tokens stop where we cut
            if error is not None:
                self._abort(self._running())
                raise error
            self.latest[request_id].add(out)

    def _abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self.cut.update(request_ids)
            self.handle.abort(request_ids)

    def _report(self) -> None:
        if self.on_result is None:
            return
        for index, request_id in enumerate(self.ids):
            if request_id in self.reported:
                continue
            if request_id in self.cut or self.latest[request_id].finished:
                self.reported.add(request_id)
                self.on_result(index, self._result(request_id))

    def run(self, prompts: list[dict], params: list, groups: list[int]) -> list[GenerationResult]:
        """Every request's result, in order (those given, then those admitted)."""
        self._add(prompts, params, groups)
        while True:
            self._take_outputs(wait=bool(self._running()))
            running = self._running()
            if running and self.interrupt is not None and self.interrupt():
                self._abort(running)
                break
            gone = self.abort_groups() if self.abort_groups is not None and running else ()
            dropped = [r for r in running if self.group_of[r] in gone]
            self._abort(dropped)  # only these leave; the call goes on with the others
            self._report()
            joined = self._admitted(len(running) - len(dropped))
            if len(running) == len(dropped) and not joined:
                break  # every request ended or was aborted, and none joins
        self._report()
        return [self._result(r) for r in self.ids]

    def _result(self, request_id: str) -> GenerationResult:
        cut = request_id in self.cut
        return vllm_result(self.latest[request_id], cut, self.renormalized, self.owner.moe_layers)
