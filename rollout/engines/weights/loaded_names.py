"""Every pushed name is loaded: an engine's first push is checked name by name.

vLLM's model loaders skip a name they do not know (``Qwen2Model.load_weights``: ``if name not
in params_dict: continue``; a tied ``lm_head.`` through ``AutoWeightsLoader``'s
``skip_prefixes``), and the layerwise reload then puts the old tensor back for a layer that
loaded nothing (``finalize_layerwise_reload``): a tensor pushed under a wrong name is dropped
without a word. Most vLLM models' ``load_weights`` return the set of parameter names they loaded
(0.24.0, 0.26.0, 0.32.0 ``model_executor/models/*.py``), so while a push is watched each tensor
is handed to the model's loader alone and one that loads no parameter is recorded.

``watch`` replaces the model's ``load_weights`` on the instance, which every path calls it
through: vLLM's worker (0.24's and vllm-ascend's ``update_weights`` pass ``model.load_weights``
to the weight-transfer engine), the engine itself (0.26's and 0.32's ``self.model.load_weights``)
and crossrl's worker extension. ``unloaded`` puts the loader back and says which names loaded
nothing. Imports nothing of vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable

#: The attribute a watched model keeps its record under.
_RECORD = "_crossrl_loaded_names"


def watch(model) -> None:
    """Record, until ``unloaded``, each name handed to ``model.load_weights`` that loads no
    parameter (each tensor goes to the loader alone: a first push costs one call a tensor)."""
    if _RECORD in vars(model):
        return
    original = model.load_weights
    # an instance's own loader (``expert_names.split_fused_experts``) comes back after
    record = {"unloaded": [], "silent": False, "handed": 0, "own": vars(model).get("load_weights")}

    def load_weights(weights: Iterable, *args, **kwargs):
        loaded: set[str] = set()
        for name, tensor in weights:
            got = original([(name, tensor)], *args, **kwargs)
            record["handed"] += 1
            if got is None:  # this model's loader reports nothing: nothing to check
                record["silent"] = True
            elif not got:
                record["unloaded"].append(name)
            else:
                loaded |= set(got)
        return loaded

    vars(model)[_RECORD] = record
    vars(model)["load_weights"] = load_weights


def unloaded(model) -> tuple[list[str], int] | None:
    """Stop watching ``model`` (``watch``): the names handed to it that loaded no parameter,
    in order, and the count of tensors handed; None when nothing was watched or its loader
    reports no names."""
    record = vars(model).pop(_RECORD, None)
    vars(model).pop("load_weights", None)
    if record is not None and record["own"] is not None:
        vars(model)["load_weights"] = record["own"]
    if record is None or record["silent"]:
        return None
    return list(dict.fromkeys(record["unloaded"])), int(record["handed"])


def unloaded_on_every_worker(per_worker: list) -> tuple[list[str], int]:
    """The names no worker loaded and the tensors handed (``unloaded`` of each worker): at
    pipeline parallel > 1 a worker holds some layers only, so a name is lost only where every
    worker skipped it."""
    known = [found for found in per_worker if found is not None]
    if not known:
        return [], 0
    lost = set.intersection(*(set(names) for names, _ in known))
    return [name for name in known[0][0] if name in lost], max(n for _, n in known)


def unloaded_error(names: list[str], pushed: int, engine: str) -> ValueError:
    """The one-line error for pushed tensors ``names`` (of ``pushed``) that ``engine`` has no
    parameter for."""
    shown = ", ".join(repr(n) for n in names[:5]) + (", ..." if len(names) > 5 else "")
    return ValueError(
        f"{engine}: {len(names)} of the {pushed} pushed tensors loaded into no parameter of "
        f"the engine's model ({shown}): the trainer's names must be the checkpoint's names "
        "the engine's loader maps (a tied lm_head.weight is not pushed)"
    )
