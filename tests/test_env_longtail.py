"""The long-tail agent workload (``rollout.envs.longtail``): heavy-tailed turns, answer lengths
and tool latencies, every draw repeatable from the episode seed."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from rollout.envs.longtail import AsyncLongTailEnv, LongTailEnv


def _draws(env: LongTailEnv, seeds: range) -> tuple[list[int], list[int], list[float]]:
    turns, lengths, delays = [], [], []
    for seed in seeds:
        env.reset(seed)
        turns.append(env.turns)
        lengths.append(env.length)
        delays.append(env.delay_s("12"))
    return turns, lengths, delays


def test_every_draw_repeats_from_the_seed():
    a, b = LongTailEnv(), LongTailEnv()
    assert _draws(a, range(50)) == _draws(b, range(50))
    a.reset(7)
    assert a.delay_s("12") != a.delay_s("13")  # samples of one prompt wait differently


def test_turns_lengths_and_latencies_have_long_tails():
    env = LongTailEnv(max_turns=6, max_length=6, median_delay_s=0.02, max_delay_s=2.0)
    turns, lengths, delays = _draws(env, range(4000))
    assert statistics.median(turns) <= 2 and max(turns) == 6
    assert 0.01 < turns.count(6) / len(turns) < 0.3  # a few episodes take every turn
    assert statistics.median(lengths) <= 2 and max(lengths) == 6
    assert 0.5 * 0.02 < statistics.median(delays) < 2 * 0.02
    ordered = sorted(delays)
    assert ordered[int(0.99 * len(ordered))] > 10 * statistics.median(delays)
    assert max(delays) <= 2.0


def test_a_per_episode_latency_waits_alike_at_every_step_of_an_episode():
    """``delay_per="episode"``: one draw per episode (a slow sandbox stays slow), still
    heavy-tailed over episodes."""
    env = LongTailEnv(delay_per="episode", median_delay_s=0.02, max_delay_s=2.0)
    env.reset(7)
    assert env.delay_s("12") == env.delay_s("13")
    env.step("12")
    assert env.delay_s("99") == env.delay_s("12")
    _, _, delays = _draws(env, range(2000))
    ordered = sorted(delays)
    assert ordered[int(0.99 * len(ordered))] > 10 * statistics.median(delays)


def test_an_episode_plays_to_its_own_end():
    env = LongTailEnv(median_delay_s=0.0, max_delay_s=0.0)
    for seed in range(20):
        obs = env.reset(seed)
        targets, done, steps = list(env._targets), False, 0
        while not done:
            assert obs or steps == 0
            obs, reward, done, _ = env.step(targets[steps])
            steps += 1
        assert steps == env.turns and reward == 1.0


def test_the_async_variant_waits_and_answers_alike():
    sync, asynchronous = LongTailEnv(max_delay_s=0.05), AsyncLongTailEnv(max_delay_s=0.05)

    async def play() -> list:
        first = await asynchronous.reset(3)
        return [first, await asynchronous.step("00")]

    assert asyncio.run(play()) == [sync.reset(3), sync.step("00")]


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"max_turns": 0}, "max_turns"),
        ({"max_length": 12}, "max_length"),
        ({"turn_alpha": 0.0}, "turn_alpha"),
        ({"median_delay_s": 3.0, "max_delay_s": 2.0}, "median_delay_s"),
        ({"delay_sigma": -1}, "delay_sigma"),
        ({"delay_per": "turn"}, "delay_per"),
    ],
)
def test_bad_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        LongTailEnv(**kwargs)
