"""Every payload crossrl's pushes build goes through each pinned engine's own parse rule (issue 56,
items 1 and 10): behaviour, not only names.

``scripts/record_transfer_api.py`` records, from the pinned wheels, each engine's
``parse_init_info`` / ``parse_update_info`` (the engine's own and vLLM's base's) and its init-
and update-info dataclasses with their defaults and ``__post_init__``, each read against the vLLM
its lane pins (vLLM 0.24.0 for ``ipc`` / ``nccl``; vLLM 0.26.0 under vllm-ascend 0.26.0rc1 for
``npu_ipc`` / ``hccl``). Here that source is executed with small stand-ins for what it imports
(vLLM's ``envs`` with insecure serialization off, as an engine starts by default; ``pickle``;
``base64``) and fed:

- the colocated push's payload (``WeightPush.push_transfer``'s ``send``, through the shipped
  push, the helper's update info built as the wheel's trainer helper builds it);
- the collective push's ``init_info`` (``WeightGroupAddress.init_info``) and ``update_info``
  (``rollout.engines.weights.transfer.update_info``, what ``WeightSender.send`` stages).

What this cannot check: anything outside the parse (the engines' transport, IPC handles, the
model's loaders), and a rule that reads more of vLLM than the recorded source and stand-ins.
"""

from __future__ import annotations

import base64
import json
import pickle
import textwrap
from abc import ABC
from collections.abc import Callable
from dataclasses import KW_ONLY, asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import pytest
import torch

import hal
from trainer.loop.cluster.local import LocalHandle
from trainer.loop.weights.colocated_push import ColocatedPush

ROOT = Path(__file__).resolve().parents[1]
API = json.loads((ROOT / "tests" / "fixtures" / "weight_transfer_api.json").read_text())
#: What the recorded source reads from outside itself: vLLM's ``envs`` as an engine starts by
#: default, the standard library and typing names of its annotations.
STANDINS = {
    "envs": SimpleNamespace(VLLM_ALLOW_INSECURE_SERIALIZATION=False),
    "pickle": pickle,
    "base64": base64,
    "dataclass": dataclass,
    "field": field,
    "KW_ONLY": KW_ONLY,
    "ABC": ABC,
    "Any": Any,
    "Literal": Literal,
    "Callable": Callable,
    "TInitInfo": Any,
    "TUpdateInfo": Any,
}
DEVICES = ("cuda", "npu")


def recorded(module: str) -> tuple[object, dict]:
    """An engine of ``module`` with only its recorded parse rule (the engine class chain, vLLM's
    base first, each with its recorded parse methods), and the namespace holding its
    dataclasses."""
    rule = API[module]["rule"]
    parts = list(rule["constants"].values()) + [d["source"] for d in rule["dataclasses"]]
    base = "object"
    for engine in rule["engines"]:
        body = [f"{k} = {engine[k]}" for k in ("init_info_cls", "update_info_cls") if k in engine]
        body += list(engine["methods"].values())
        parts.append(
            f"class {engine['class']}({base}):\n" + textwrap.indent("\n".join(body), "    ")
        )
        base = engine["class"]
    namespace = {"__name__": f"recorded {module}", **STANDINS}
    code = compile("\n\n".join(parts), f"<recorded {module}>", "exec", dont_inherit=True)
    exec(code, namespace)  # noqa: S102 - source recorded from the pinned wheels
    return namespace[base](), namespace


def _lane(device: str, attribute: str) -> str:
    """The engine module the HAL names for ``device`` (``weight_transfer_trainer`` or
    ``colocated_transfer_trainer``)."""
    return getattr(hal.backend_class(device)(), attribute)[0]


def test_each_lane_is_read_in_the_vllm_it_pins():
    for device, pins in (("cuda", ["vllm 0.24.0"]), ("npu", ["vllm 0.26.0", "vllm_ascend"])):
        for attribute in ("weight_transfer_trainer", "colocated_transfer_trainer"):
            read_in = API[_lane(device, attribute)]["read_in"]
            assert all(any(r.startswith(p) for r in read_in) for p in pins), read_in


# ----------------------------------------------------------------- the colocated push's payload


class RecordedHelper:
    """A trainer helper (``trainer_send_weights``) that builds each chunk's update info as
    the wheel's ``_send_packed`` / ``_do_send`` do (``names``, ``dtype_names``, ``shapes``,
    ``packed``, ``tensor_sizes``, ``ipc_handles``: one buffer's handle keyed by device), of the
    recorded class ``info_cls``, and hands it to ``send_mode``."""

    info_cls: type = None

    @classmethod
    def trainer_send_weights(cls, iterator, trainer_args) -> None:
        chunk = list(iterator)
        fields = {
            "names": [name for name, _ in chunk],
            "dtype_names": [str(t.dtype).split(".")[-1] for _, t in chunk],
            "shapes": [list(t.shape) for _, t in chunk],
            "packed": True,
            "tensor_sizes": [t.numel() * t.element_size() for _, t in chunk],
            "ipc_handles": {"device-uuid": ("rebuild", "args")},
        }
        trainer_args["send_mode"](cls.info_cls(**fields))


class ParsingReplica:
    """An engine replica whose ``receive_chunk`` runs the recorded parse rule on the payload."""

    def __init__(self, engine) -> None:
        self.engine, self.parsed = engine, []

    def start_transfer(self) -> None:
        pass

    def receive_chunk(self, update_info: dict) -> int:
        self.parsed.append(self.engine.parse_update_info(dict(update_info)))
        return len(update_info["names"])

    def finish_transfer(self) -> None:
        pass

    def abort_transfer(self) -> None:
        pass


class OneRank(ColocatedPush):
    """Training rank 0 of 1, pushing ``state`` with ``RecordedHelper``."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        cfg = SimpleNamespace(model=SimpleNamespace(dtype="bfloat16"))
        self.spec = SimpleNamespace(rank=0, world_size=1, cfg=cfg)
        helper = (__name__, "RecordedHelper")
        self.backend = SimpleNamespace(colocated_transfer_trainer=helper, is_accelerator=False)
        self.state = state

    def push_state(self) -> dict[str, torch.Tensor]:
        return self.state


def _state() -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": torch.ones(4, 2), "model.norm.weight": torch.ones(2)}


@pytest.mark.parametrize("device", DEVICES)
def test_the_colocated_payload_passes_the_engines_own_parse(device, monkeypatch):
    """The payload ``push_transfer`` hands every replica parses under the recorded rule of
    the HAL's colocated engine (vLLM 0.24's ``ipc``, vllm-ascend's ``npu_ipc`` on 0.26)."""
    engine, namespace = recorded(_lane(device, "colocated_transfer_trainer"))
    monkeypatch.setattr(RecordedHelper, "info_cls", engine.update_info_cls)
    replica = ParsingReplica(engine)
    state = _state()
    assert OneRank(state).push_transfer([LocalHandle(replica)], 1 << 20) == 1
    (parsed,) = replica.parsed
    assert parsed.names == list(state) and parsed.dtype_names == ["bfloat16"] * 2
    assert parsed.ipc_handles == {"device-uuid": ("rebuild", "args")} and parsed.packed


def test_the_recorded_npu_rule_refuses_a_payload_with_both_handle_keys():
    """What the rule caught: the dataclass's fields in full (``asdict``) carry
    ``ipc_handles_pickled=None`` beside ``ipc_handles``; vllm-ascend's parse tests presence."""
    engine, _ = recorded(_lane("npu", "colocated_transfer_trainer"))
    info = engine.update_info_cls(
        names=["a"], dtype_names=["float32"], shapes=[[1]], ipc_handles={"u": ()},
        tensor_sizes=[4], packed=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="Cannot specify both"):
        engine.parse_update_info(asdict(info))


# ----------------------------------------------------------------- the collective push's payloads


@pytest.mark.parametrize("device", DEVICES)
def test_the_collective_push_init_and_update_info_pass_the_engines_own_parse(device):
    """``WeightGroupAddress.init_info`` and the sender's ``update_info`` parse under the
    recorded rule of the HAL's engine of its own (vLLM 0.24's ``nccl``, vllm-ascend's ``hccl``
    on 0.26), every key kept."""
    from rollout.engines.weights.transfer import (
        PACKED_BUFFER_BYTES,
        PACKED_NUM_BUFFERS,
        update_info,
    )
    from trainer.loop.weights.weight_group import WeightGroupAddress

    backend = hal.backend_class(device)()
    engine, _ = recorded(_lane(device, "weight_transfer_trainer"))
    address = WeightGroupAddress("10.0.0.1", 29500, 2, 4, backend.weight_transfer_engine, 60.0)
    init = address.init_info(1, 29600, 2)
    parsed = engine.parse_init_info(dict(init))
    assert {k: getattr(parsed, k) for k in init} == init
    state = {n: t.to(torch.bfloat16) for n, t in _state().items()}
    info = update_info(state.items(), None, PACKED_BUFFER_BYTES, PACKED_NUM_BUFFERS)
    parsed = engine.parse_update_info(dict(info))
    assert {k: getattr(parsed, k) for k in info} == info
    with pytest.raises(ValueError, match="same size"):  # the rule is live: it checks lengths
        engine.parse_update_info({**info, "shapes": info["shapes"][:1]})
