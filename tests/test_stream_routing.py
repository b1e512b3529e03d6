"""Issue 57's defects 1-4 of the stream's engine side (``rollout.versioned.VersionedEngine``,
``rollout.engines.serving.router``, ``trainer.loop.engines.remote_engine``): a replacement replica
serves the stream and a lost replica's requests go to live lanes, counted (1); continued
requests with different budgets left share one engine call (2); an abort ends only its own
group's requests, and a group aborted while queued is never sent (3); a load with partial
rollouts ends a remote replica's call too (4)."""

from __future__ import annotations

import threading
import time

import pytest

from rollout.engines.base import GenerationRequest, GenerationResult, SamplingParams
from rollout.streaming import GroupAborted, VersionedEngine
from trainer.loop.engines.engine_host import EngineHost


def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def _in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    """``fn(*args)`` on a thread of its own; ``out["value"]`` or ``out["error"]`` after."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


class _Budgeted:
    """An interruptible replica: its first call runs until interrupted (a long decode) and
    gives request k ``1 + 2k`` tokens; later calls answer each request with its own budget
    (``GenerationRequest.budget``) of tokens. Records every call's requests."""

    interruptible = True

    def __init__(self) -> None:
        self.calls: list[list[GenerationRequest]] = []

    def generate(self, requests, sampling, interrupt=None):
        self.calls.append(list(requests))
        if len(self.calls) == 1:
            _until(lambda: interrupt is not None and interrupt())
            return [
                GenerationResult([7] * (1 + 2 * k), [0.0] * (1 + 2 * k), "interrupted")
                for k in range(len(requests))
            ]
        budgets = [getattr(r, "max_new_tokens", None) or sampling.max_new_tokens for r in requests]
        return [GenerationResult([8] * b, [0.0] * b, "length") for b in budgets]


# ---------------------------------------------------------------- 2: one call, many budgets


def test_continued_requests_with_different_budgets_left_go_in_one_engine_call():
    """A load (partial rollouts) cuts a call whose requests had sampled 1 and 3 tokens. Before
    issue 57 they went on in two calls, one per remaining budget (15 and 13 tokens written into
    the call's SamplingParams); now in one call, each request carrying its own budget left."""
    replica = _Budgeted()
    versioned = VersionedEngine(replica, partial=True)
    requests = [GenerationRequest([1, 2], seed=s, group=0) for s in (0, 1)]
    thread, out = _in_thread(versioned.generate, requests, SamplingParams(max_new_tokens=16))
    _until(lambda: len(replica.calls) == 1)
    versioned.load(lambda: None, 1)
    thread.join(30)
    assert "error" not in out
    assert len(replica.calls) == 2  # the cut call, then one call for both continuations
    assert [r.max_new_tokens for r in replica.calls[1]] == [15, 13]
    assert [len(r.prompt_ids) for r in replica.calls[1]] == [3, 5]
    for result in out["value"]:
        assert len(result.token_ids) == 16 and result.finish_reason == "length"
        assert set(result.extra["versions"][:1]) == {0} and result.extra["versions"][-1] == 1


def _hf_engine():
    from rollout.engines import make_engine
    from rollout.tokenizer import load_tokenizer

    return make_engine("hf", "builtin:tiny", load_tokenizer("builtin"), seed=1)


def test_the_hf_engine_honours_each_request_s_own_budget():
    """One call, three budgets: each request samples what it would alone under a call of its
    own budget (its own seeded sampler), and no more."""
    engine = _hf_engine()
    sampling = SamplingParams(max_new_tokens=5)
    requests = [
        GenerationRequest([5, 17, 33], seed=11, max_new_tokens=3),
        GenerationRequest([40, 41], seed=12, max_new_tokens=9),
        GenerationRequest([9, 9, 9, 9], seed=13),  # the call's 5
    ]
    together = engine.generate(requests, sampling)
    assert [len(r.token_ids) for r in together] == [3, 9, 5]
    assert all(r.finish_reason == "length" for r in together)
    for request, result in zip(requests, together):
        alone = engine.generate(
            [GenerationRequest(request.prompt_ids, request.seed)],
            SamplingParams(max_new_tokens=request.budget(sampling)),
        )[0]
        assert result.token_ids == alone.token_ids
        assert result.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        GenerationRequest([1], seed=0, max_new_tokens=0)


# ---------------------------------------------------------------- 3: aborts end their group


class _Held:
    """A replica whose calls wait for ``gate`` (polling ``interrupt`` and, when
    ``abortable``, ``abort_groups``); the requests of groups ``abort_groups`` names end at
    once with one token, the rest with three once the gate opens. Records every call's
    requests by their seed (``_ask`` seeds a group's requests with its number: an engine server
    numbers the requests of its batch in their ``group``, for its aborts), and whether
    ``interrupt`` ever said True."""

    interruptible = True

    def __init__(self, abortable: bool = True) -> None:
        self.abortable = abortable
        self.first, self.gate = threading.Event(), threading.Event()  # the first call's, later
        self.calls: list[list[int]] = []
        self.interrupted = False
        self.ended: set[int] = set()  # groups whose requests abort_groups ended

    def generate(self, requests, sampling, interrupt=None, abort_groups=None):
        self.calls.append([r.seed for r in requests])
        gate = self.first if len(self.calls) == 1 else self.gate
        ended: dict[int, GenerationResult] = {}
        while not gate.wait(0.01) and len(ended) < len(requests):
            if interrupt is not None and interrupt():
                self.interrupted = True
                break
            gone = abort_groups() if abort_groups is not None else frozenset()
            for i, request in enumerate(requests):
                if request.group in gone and i not in ended:
                    ended[i] = GenerationResult([4], [0.0], "interrupted")
                    self.ended.add(request.seed)
        reason = "interrupted" if self.interrupted else "length"
        return [
            ended.get(i, GenerationResult([1, 2, 3], [0.0] * 3, reason))
            for i in range(len(requests))
        ]


def _ask(engine, group: int) -> tuple[threading.Thread, dict]:
    request = [GenerationRequest([1], seed=group, group=group)] * 2
    return _in_thread(engine.generate, request, SamplingParams(max_new_tokens=3))


def test_a_group_aborted_while_queued_is_never_sent():
    """Group 3 waits in the lane's queue behind group 9's call when it is aborted. Before
    issue 57 its requests were still sent in the lane's next call; now they leave the queue
    unsent and its caller raises GroupAborted, while group 8 queued beside it is sent."""
    replica = _Held()
    versioned = VersionedEngine(replica)
    versioned._tokens[3] = {0: 5}  # group 3 sampled under version 0 before
    first = _ask(versioned, 9)
    _until(lambda: len(replica.calls) == 1)
    rest = {g: _ask(versioned, g) for g in (3, 8)}
    _until(lambda: versioned._lanes[0].server.queued() == 4)  # two groups, two each
    assert versioned.abort_older_than(1) == [3]
    replica.first.set()
    replica.gate.set()
    for thread, _ in [first, *rest.values()]:
        thread.join(30)
    assert isinstance(rest[3][1].get("error"), GroupAborted)
    assert replica.calls == [[9, 9], [8, 8]]  # group 3 never reached the engine
    assert [r.token_ids for r in rest[8][1]["value"]] == [[1, 2, 3]] * 2


def test_an_abort_ends_only_its_group_s_requests_and_the_call_goes_on():
    """Groups 3 and 8 share a call on an engine that can end one group's requests alone
    (``abortable``). Before issue 57 the abort of group 3 interrupted the whole call and
    group 8 went on in a call of its own; now only group 3's requests end, group 8's finish
    in the same call."""
    replica = _Held()
    versioned = VersionedEngine(replica)
    versioned._tokens[3] = {0: 5}
    first = _ask(versioned, 9)  # the replica busy: the next two wait together
    _until(lambda: len(replica.calls) == 1)
    both = {g: _ask(versioned, g) for g in (3, 8)}
    _until(lambda: versioned._lanes[0].server.queued() == 4)  # two groups, two each
    replica.first.set()
    first[0].join(30)
    versioned.tokens_of(9)  # finished: its sampler takes its counts
    _until(lambda: len(replica.calls) == 2)
    assert sorted(replica.calls[1]) == [3, 3, 8, 8]
    assert versioned.abort_older_than(1) == [3]
    _until(lambda: replica.ended == {3})  # its requests end mid-call; the call goes on
    replica.gate.set()
    for thread, _ in both.values():
        thread.join(30)
    assert isinstance(both[3][1].get("error"), GroupAborted)
    assert [r.token_ids for r in both[8][1]["value"]] == [[1, 2, 3]] * 2
    assert len(replica.calls) == 2 and not replica.interrupted  # no call of its own
    assert versioned.interruptions == 0 and versioned.group_aborts == 1


def test_the_hf_engine_ends_an_aborted_group_between_decode_steps_and_the_rest_goes_on():
    engine = _hf_engine()
    sampling = SamplingParams(max_new_tokens=12)
    requests = [GenerationRequest([5, 17, 33], seed=20 + g, group=g) for g in (0, 1, 0, 1)]
    polls = []

    def abort_groups():  # polled as the batch starts, then after each decode step
        polls.append(1)
        return frozenset({1}) if len(polls) >= 4 else frozenset()  # after the third

    out = engine.generate(requests, sampling, abort_groups=abort_groups)
    alone = engine.generate([requests[0], requests[2]], sampling)
    assert [len(r.token_ids) for r in out] == [12, 3, 12, 3]
    assert [r.finish_reason for r in out] == ["length", "interrupted"] * 2
    assert [out[0].token_ids, out[2].token_ids] == [r.token_ids for r in alone]
    assert out[1].token_ids == engine.generate([requests[1]], sampling)[0].token_ids[:3]


@pytest.mark.vllm
def test_vllm_takes_a_budget_per_request_and_ends_an_aborted_group_alone(tmp_path):
    """vLLM's engine (``VLLMEngine``): one call whose requests carry budgets of their own (a
    ``SamplingParams`` per prompt), and an abort of group 1 between engine steps that ends its
    requests by id while group 0's run to their end, sampling what they sample alone."""
    pytest.importorskip("vllm")
    from tests.test_rollout_vllm import _save_tiny_qwen2, _tiny_engine

    engine = _tiny_engine(_save_tiny_qwen2(tmp_path / "tiny", 1))
    try:
        sampling = SamplingParams(max_new_tokens=6)
        budgets = [
            GenerationRequest([5, 17, 33], seed=31, max_new_tokens=3),
            GenerationRequest([40, 41], seed=32, max_new_tokens=9),
            GenerationRequest([9, 9, 9], seed=33),
        ]
        together = engine.generate(budgets, sampling)
        assert [len(r.token_ids) for r in together] == [3, 9, 6]
        for request, result in zip(budgets, together):
            alone = engine.generate(
                [GenerationRequest(request.prompt_ids, request.seed)],
                SamplingParams(max_new_tokens=request.budget(sampling)),
            )[0]
            assert result.token_ids == alone.token_ids

        sampling = SamplingParams(max_new_tokens=12)
        requests = [GenerationRequest([5, 17, 33], seed=40 + g, group=g % 2) for g in range(4)]
        polls = []

        def abort_groups():
            polls.append(1)
            return frozenset({1}) if len(polls) >= 3 else frozenset()

        out = engine.generate(requests, sampling, abort_groups=abort_groups)
        alone = engine.generate(requests, sampling)
        for request, result, full in zip(requests, out, alone):
            if request.group == 0:
                assert result.finish_reason == "length" and result.token_ids == full.token_ids
            else:
                assert result.finish_reason == "interrupted"
                assert 0 < len(result.token_ids) < 12
                assert result.token_ids == full.token_ids[: len(result.token_ids)]
    finally:
        engine.shutdown()


# ---------------------------------------------------------------- 1: the stream follows the router


class _Peer:
    """An ``EngineHost`` stand-in behind a ``LocalHandle`` (a peer replica; replica 0 when
    used as the host's own engine): answers each request with one token and records the
    prompts it served (by seed: an engine server numbers its batch's requests in ``group``); with ``dies``, every call raises ``ReplicaLostError`` (its process is
    gone)."""

    def __init__(self, dies: bool = False, hold: threading.Event | None = None) -> None:
        self.dies, self.tries, self.served, self.loads = dies, 0, [], 0
        self.hold = hold  # set: calls answer; clear: they wait (keeping their load)

    def generate(self, requests, sampling, *_call, **_kwargs):
        from rollout.engines.serving.router import ReplicaLostError

        self.tries += 1
        if self.dies:
            raise ReplicaLostError("engine replica is lost: its process died")
        if self.hold is not None:
            assert self.hold.wait(60)
        self.served += [r.seed for r in requests]  # its prompt's ordinal (``_rollout_host``)
        return [GenerationResult([1], [0.0], "length") for _ in requests]

    def load_host_buckets(self, refs, specs) -> None:
        self.loads += 1

    def start_server(self, version: int) -> None:
        """``EngineHost.start_server``: its engine (itself) served from now on."""
        from rollout.engines.serving.server import EngineServer

        if getattr(self, "server", None) is None:
            self.server = EngineServer(self, version)

    def shutdown(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.close()
        self.shut = True


def _rollout_host(tmp_path, engine):
    """The shipped ``RolloutHost`` (connect, take_weights, the stream) over stub engines,
    prompts and agent loop: each group makes one engine call, with its ordinal as group."""
    from rollout.agent_loop import RolloutOutput
    from trainer.config import load_config
    from trainer.loop.engines.rollout_host import RolloutHost

    cfg = load_config(
        None,
        [
            "train.max_staleness=1",
            "rollout.engine_devices=3",
            "algorithm.rollout_correction=token",
            "train.batch_size=2",
            "train.mini_batch_size=2",
            f"run.dir={tmp_path}",
        ],
    )

    class Host(RolloutHost):
        def _sample(self, ordinal, items, engine=None, env_slots=None):
            request = GenerationRequest([1], seed=ordinal, group=ordinal)
            engine.generate([request], SamplingParams())
            return RolloutOutput(rows=[], metrics={}, faults=[])

        def _batch_out(self, step, out, record_dir, version):
            return {"metrics": out.metrics, "policy_version": version}, [out]

        def load_host_buckets(self, refs, specs) -> None:  # its own engine's load
            pass

    host = Host(cfg)
    host.engine = host.generator = engine
    host.peers, host.waiting, host.weights_version, host.weight_load_s = [], [], 0, 0.0
    host.prompts = type("Prompts", (), {"take": lambda self, first, count: [first]})()
    host.prompts_consumed = 0
    return host


def test_a_lost_replica_s_requests_go_to_live_lanes_and_its_replacement_serves_the_stream(
    tmp_path,
):
    """Three replicas; each new prompt goes to the least-loaded one. Replicas 0 and 1 hold
    their first calls, so replica 2 (lost at its first call) is the least loaded and takes a
    prompt: its request goes to a live lane (counted in ``stream/requests_resubmitted``) and its
    lane takes no more work. The controller connects a replacement, which the next load fills:
    from then on new prompts go to it. Before issue 57 the stream kept the router of its start,
    and the replacement never served it."""
    from trainer.loop.cluster.local import LocalHandle

    hold = threading.Event()
    local, a, lost, replacement = _Peer(hold=hold), _Peer(hold=hold), _Peer(dies=True), _Peer()
    host = _rollout_host(tmp_path, local)
    assert host.connect([LocalHandle(a), LocalHandle(lost)]) == 3
    host.stream_start(0, 1)  # 2 prompts a step, s = 1: prompts 0..3 start
    try:
        _until(lambda: lost.tries == 1)
        hold.set()
        _until(lambda: host.stream.waiting == 4)
        metrics = host.stream_take(1, None, timeout_s=60)[0]["metrics"]
        assert metrics["stream/requests_resubmitted"] == 1.0  # the lost replica's one request
        assert lost.tries == 1 and lost.served == []
        assert sorted(local.served + a.served) == [0, 1, 2, 3]  # each prompt once, on a live one
        assert host.generator.take_lost() == [2]
        # the controller's replacement (trainer.loop.schedule.replicas): connected, then loaded
        host.connect([LocalHandle(a), LocalHandle(replacement)], waiting=[2])
        assert host.take_weights([1, "refs", "specs"]) == 1 and replacement.loads == 1
        # prompts 4 and 5 start under version 1: the idle replacement takes one
        _until(lambda: bool(replacement.served))
        assert lost.tries == 1
    finally:
        host.stream_shutdown(timeout_s=10)


def test_a_new_prompt_goes_to_the_least_loaded_replica_and_stays_there_while_it_runs():
    """``Lanes.route``: a new prompt is placed on the replica with the fewest requests in
    flight (ties dealt by the prompt); its later turns stay there (its prefix) however loaded
    that replica gets; once done (``forget``) it is placed anew; a request of no prompt of the
    stream (``place=False``) is not placed; a replica out of the routing takes none."""
    from rollout.engines.serving.router import ReplicaRouter
    from rollout.stream_lanes import Lanes

    router = ReplicaRouter([_Peer(), _Peer(), _Peer()])
    lanes = Lanes(router)
    first = lanes.route(0)
    assert first is lanes.lanes[0]  # all idle: dealt by the prompt, 0 % 3
    lanes.started(first, 8)
    assert lanes.route(1) is lanes.lanes[2]  # idle ones 1 and 2: 1 % 2
    lanes.started(lanes.lanes[2], 8)
    assert lanes.route(7) is lanes.lanes[1]  # the only idle one
    lanes.started(lanes.lanes[1], 1)
    lanes.started(first, 100)
    assert lanes.route(0) is first  # its next turn: where its prefix is
    lanes.forget(0)
    assert lanes.route(0) is lanes.lanes[1]  # placed anew: the least loaded now
    assert lanes.route(50, place=False) is lanes.lanes[1] and 50 not in lanes.placed
    router.mark_lost(1)
    assert lanes.route(0) is lanes.lanes[2]  # its replica left the routing: placed anew
    lanes.ended(first, 108)
    assert lanes.route(9) is first


def test_a_shut_down_rollout_host_holds_no_other_replica_s_handle(tmp_path):
    """``Trainer.shutdown`` asks each replica to shut down before it kills them; the rollout
    host then holds no handle to another replica (not in its router, its stream's lanes or its
    remote engines), so none is dropped as ray kills the process, which printed a traceback
    on the driver's stderr (CI, test_pairwise_matrix run15)."""
    import gc
    import weakref

    from trainer.loop.cluster.local import LocalHandle

    local, peers = _Peer(), [LocalHandle(_Peer()), LocalHandle(_Peer())]
    host = _rollout_host(tmp_path, local)
    host.connect(peers)
    host.stream_start(0, 1)
    _until(lambda: host.stream.waiting == 4)
    held = [weakref.ref(p) for p in peers]
    del peers
    host.shutdown()
    gc.collect()
    assert [ref() for ref in held] == [None, None]
    assert host.generator is local and local.shut


# ---------------------------------------------------------------- 4: remote calls interrupted


class _UntilInterrupted:
    """A replica's engine whose first call decodes until it is interrupted (up to 120 s, a
    long tail) and whose later calls answer at once; ``abort_groups`` ends those groups'
    requests alone, and requests ``admit`` lets in join the first call (an engine server's
    batch). Records the prompts of every call: the first token of each request's, the caller's
    group (a server numbers the requests of its batch in their ``group``, for its aborts)."""

    interruptible = abortable = joinable = True

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def generate(
        self, requests, sampling, interrupt=None, abort_groups=None, admit=None, on_result=None
    ):
        requests = list(requests)
        self.calls.append([r.prompt_ids[0] for r in requests])
        if len(self.calls) > 1:
            return [GenerationResult([2], [0.0], "length") for _ in requests]
        ended: dict[int, GenerationResult] = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (interrupt is not None and interrupt()):
            joining = admit(8) if admit is not None else []
            requests += joining
            self.calls[-1] += [r.prompt_ids[0] for r in joining]
            gone = abort_groups() if abort_groups is not None else frozenset()
            for i, r in enumerate(requests):
                if r.group in gone:
                    ended.setdefault(i, GenerationResult([9], [0.0], "interrupted"))
            time.sleep(0.01)
        cut = GenerationResult([1], [0.0], "interrupted")
        return [ended.get(i, cut) for i in range(len(requests))]


class _PeerHost(EngineHost):
    """The shipped ``EngineHost`` (its ``generate`` and ``interrupt_call``) over the stub
    engine above (imported by Ray's worker as ``tests.test_stream_routing``)."""

    def setup(self):
        self.engine = _UntilInterrupted()

    def engine_calls(self):
        return self.engine.calls


@pytest.mark.slow
def test_a_load_with_partial_rollouts_ends_a_remote_replica_s_call_too(local_ray, tmp_path):
    """Two replicas, each in a call that decodes until interrupted; group 3 on the remote one
    is aborted mid-call first. Before issue 57 only the local replica's call could be
    interrupted: the load waited for the remote call's end (here 120 s, a long tail) and the
    abort cut nothing there. Now the remote call ends group 3's requests alone, then ends at
    the load, and the callers go on under the new weights."""
    import ray

    from rollout.engines.serving.router import ReplicaRouter
    from tests.test_stream_routing import _PeerHost  # by a name Ray's workers import
    from trainer.config import load_config
    from trainer.loop.engines.remote_engine import RemoteEngine, peer_actor_options

    cfg = load_config(
        None,
        [
            "train.max_staleness=1",
            "rollout.engine_devices=2",
            "algorithm.rollout_correction=token",
            f"run.dir={tmp_path}",
        ],
    )
    options = peer_actor_options(cfg)
    peer = ray.remote(**options)(_PeerHost).options(num_cpus=0).remote(cfg, 1, 1)
    ray.get(peer.setup.remote())
    calls = peer.engine_calls.options(concurrency_group="control")  # beside its call
    router = ReplicaRouter([_UntilInterrupted(), RemoteEngine(peer, 1, controllable=True)])
    versioned = VersionedEngine(router, partial=True)
    assert versioned.partial and all(lane.interruptible for lane in versioned._lanes)
    try:
        versioned._tokens[3] = {0: 5}  # group 3 sampled under version 0 before
        sampling = SamplingParams(max_new_tokens=4)
        callers = {
            g: _in_thread(versioned.generate, [GenerationRequest([g], seed=g, group=g)], sampling)
            for g in (0, 1, 3)  # 0 on the local replica, 1 and 3 on the remote one
        }
        _until(lambda: ray.get(calls.remote()) == [[1, 3]])
        assert versioned.abort_older_than(1) == [3]
        time.sleep(0.2)  # the remote call reads the abort; nothing else ends it
        loader = _in_thread(versioned.load, lambda: None, 1)[0]
        loader.join(60)
        assert not loader.is_alive()  # before: blocked until the remote call's 120 s ran out
        for thread, _ in callers.values():
            thread.join(60)
        assert isinstance(callers[3][1].get("error"), GroupAborted)
        for g in (0, 1):
            result = callers[g][1]["value"][0]
            assert result.token_ids[0] == 1 and result.extra["versions"][0] == 0
            assert result.extra["versions"][-1] == 1  # went on under the new weights
        assert ray.get(calls.remote()) == [[1, 3], [1]]
    finally:
        versioned.close(10)
        router.shutdown()
        ray.kill(peer)


@pytest.mark.slow
def test_a_streamed_run_on_two_replicas_serves_both_and_keeps_its_bound(local_ray, tmp_path):
    """A streamed run (s = 1, partial rollouts) on two HF engine replicas of their own: replica
    0 serves through its engine server in the rollout host, replica 1 through its own in its
    process (``RemoteServer``); every step trains within the bound, each sampled token records
    the policy that sampled it, and the served turns' waits are reported."""
    from rollout.replay import load_rollout
    from trainer.config import load_config
    from trainer.loop.start.run import run_training
    from trainer.records.jsonl_files import read_jsonl

    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "rollout.engine_devices=2",
            "train.max_staleness=1",
            "rollout.partial_rollout=true",
            "algorithm.rollout_correction=token",
            "rollout.env=rollout.envs.longtail:LongTailEnv",
            "rollout.max_turns=3",
            "train.batch_size=4",
            "train.mini_batch_size=2",
            "train.total_steps=3",
            "ray.in_process=false",
            "run.resume=never",
            f"run.dir={run_dir}",
        ],
    )
    assert run_training(cfg) == 0
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for step, r in enumerate(records, start=1):
        assert 0 <= r["stream/staleness_min"] <= r["stream/staleness_max"] <= 1
        arrays = load_rollout(run_dir / "rollouts" / f"step_{step}.npz")
        sampled = arrays["token/policy_version"][arrays["token/loss_mask"] > 0]
        assert sampled.min() >= max(0, step - 2) and sampled.max() <= step - 1
    assert any(r.get("stream/turn_wait_p99_ms", -1) >= 0 for r in records)


def test_a_peer_s_batches_count_in_the_stream_s_engine_time_as_the_local_replica_s():
    """Replica 1 is a peer serving through its own engine server (here in this process, its
    host's ``EngineServer`` itself); its batches reach the stream's counters when the step
    asks (``count_peer_batches``), as the local replica's do as they end, so
    ``stream/engine_idle_share`` and ``stream/requests_per_call`` cover every replica. Before,
    a peer's served batches counted nowhere."""
    from rollout.engines.serving.router import ReplicaRouter
    from trainer.loop.cluster.local import LocalHandle
    from trainer.loop.engines.remote_engine import RemoteEngine

    local, peer = _Peer(), _Peer()
    router = ReplicaRouter([local, RemoteEngine(LocalHandle(peer), 1, controllable=True)])
    versioned = VersionedEngine(router)
    try:
        assert versioned._lanes[1].server is peer.server  # no proxy in one process
        sampling = SamplingParams(max_new_tokens=1)
        for group in (0, 1):  # all idle: prompt g dealt to replica g
            versioned.generate([GenerationRequest([1], seed=group, group=group)] * 3, sampling)
        assert local.served == [0, 0, 0] and peer.served == [1, 1, 1]
        assert versioned.call_sizes == [3]  # the local server's batch, counted as it ended
        versioned.count_peer_batches()
        assert versioned.call_sizes == [3, 3] and versioned.generated_tokens == 6
        versioned.count_peer_batches()  # each batch once
        assert versioned.call_sizes == [3, 3]
    finally:
        versioned.close(10)
        peer.shutdown()
