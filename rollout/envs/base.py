"""The environment interface and the reward-shaping helper the built-in envs share.

An environment is a multi-turn text game:

- ``reset(seed) -> str | list[dict]``: start a new episode deterministically from ``seed``; the
  first observation (the user's first message), or a whole chat to start from (a list of
  ``{"role", "content"}`` messages, e.g. a dataset row's system + user prompt).
- ``step(action_text) -> (observation, reward, done, info)``: the model's reply (decoded text,
  special tokens removed); the next observation (a str, ignored when ``done``), a reward (a
  finite real number inside the class's ``reward_range``), whether the episode ended (a
  ``bool``) and free-form info.
- ``reward_range = (low, high)``: a class attribute, the inclusive range of the rewards the
  environment can return; ``(0.0, 1.0)`` for the built-ins and for a user class that does not
  declare one. A reward outside it, a non-finite reward, or a value of the wrong type is an
  environment fault: it ends that trajectory (score 0), is counted in ``rollout/env_errors``,
  and when more than ``run.max_env_error_fraction`` of a step's trajectories fault the run
  stops, showing the faults.

Both methods may be ``async def`` (awaited on the agent loop's event loop: never block in them)
or plain methods (run on a worker thread, so they may block on I/O). An environment whose plain
methods are quick computations (no I/O, no sleeping, like the built-ins) declares the class
attribute ``inline = True``: the agent loop then calls them directly on its event loop,
without the thread hop (about 0.1 ms a call). The declaration belongs to the class that
defines the method (``runs_inline``): a subclass that overrides ``reset`` or ``step`` runs
them on worker threads unless it declares ``inline`` itself, and an instance may still opt out
(``self.inline = False``). An inline call that overruns ``rollout.env_timeout_s`` ends its
trajectory once it returns (it cannot be interrupted). Every trajectory has its own
environment instance, and the agent loop runs up to ``rollout.env_concurrency`` calls at once;
state shared between instances needs a lock. A call that takes longer than
``rollout.env_timeout_s`` seconds ends its trajectory like any other fault (a thread cannot be
killed: a stuck plain method keeps running, abandoned). The constructor runs on the caller's
thread, in trajectory order.

Convention for the trajectory outcome: the reward of the FINAL step is the trajectory's score
(the agent loop copies it to every step row), so an env that wants to credit several turns
reports their aggregate on its last step. Rewards of earlier steps are per-turn progress
signals kept as ``step_reward``.

Model output is untrusted input: envs and their tools parse it with plain string code, never
``eval``/``exec`` or a shell.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

#: The reward range of an environment class that does not declare ``reward_range``.
DEFAULT_REWARD_RANGE: tuple[float, float] = (0.0, 1.0)


class Env(ABC):
    """A multi-turn text environment (see module docstring for the contract)."""

    #: inclusive (low, high) of the rewards ``step`` returns; anything outside is a fault
    reward_range: tuple[float, float] = DEFAULT_REWARD_RANGE
    #: True: ``reset``/``step`` are quick computations, called on the event loop (see above)
    inline: bool = False

    @abstractmethod
    def reset(self, seed: int) -> str | list[dict]:
        """Start an episode from ``seed``; return the first observation (or chat messages)."""

    @abstractmethod
    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        """Apply the model's reply; return (observation, reward in ``reward_range``, done,
        info)."""


def runs_inline(env: object, method: str) -> bool:
    """Whether ``env.<method>`` may run on the agent loop's event loop: the class that defines
    the method (the first in the MRO whose own body has it) declares ``inline = True`` in its
    own body, and the instance has not set ``inline`` to anything else. A subclass that
    overrides ``reset`` or ``step`` does not inherit its parent's declaration."""
    owner = next((c for c in type(env).__mro__ if method in vars(c)), None)
    if owner is None or vars(owner).get("inline") is not True:
        return False
    return getattr(env, "inline", False) is True


def _char_class(ch: str) -> int:
    return 0 if ch.isdigit() else 1 if ch.isalpha() else 2 if ch.isspace() else 3


def match_credit(response: str, target: str) -> float:
    """Partial credit in [0, 1] for answering ``target`` (a short string) with ``response``.

    0.3 x the fraction of the first ``len(target)`` response characters in the same class
    (digit / letter / space / other) as the target's (format),
    + 0.2 / (1 + |len(stripped response) - len(target)|) (length, graded so near misses count),
    + 0.5 x the fraction of positions where response and target agree (content).
    For a digit target a uniform random policy over ~100 characters scores about 0.03-0.1;
    preferring digits alone reaches ~0.35 and stopping at the right length ~0.55, so a tiny
    model sees a gradient long before it can solve the task.
    """
    if not target:
        raise ValueError("match_credit target is empty; give the expected answer string")
    text = response.strip()
    form = sum(_char_class(a) == _char_class(b) for a, b in zip(text, target)) / len(target)
    length = 1.0 / (1 + abs(len(text) - len(target)))
    agree = sum(a == b for a, b in zip(text, target)) / len(target)
    return 0.3 * form + 0.2 * length + 0.5 * agree
