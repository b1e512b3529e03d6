"""torch_npu's fused ops in their documented layouts (``hal.npu_kernels``): ``npu_swiglu``
fed one ``[gate; up]`` projection, no ``cat`` of the two activations; ``npu_rotary_mul`` in
BSND (its stand-in in ``tests/test_kernels.py`` asserts the layout and the [-1, 1] range of
cos and sin), and a rope whose ``attention_scaling`` is not 1 keeping the reference. The
stand-ins and the model helpers are ``tests/test_kernels.py``'s."""

from __future__ import annotations

import warnings

import pytest
import torch

from hal.kernels import LIGER, REFERENCE, TORCH_NPU, choose_kernels
from tests import test_kernels
from tests.test_kernels import _fused, _here, _run, _tiny, stand_ins  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("stand_ins")


def _equal(got, want) -> None:
    """``_run``'s outputs and gradients equal in fp32, up to the summation order (relative
    to each tensor's largest entry: v_proj's bias gradient reaches about 500 here)."""
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for name, grad in want[1].items():
        atol = 1e-6 * max(1.0, grad.abs().max().item())
        torch.testing.assert_close(got[1][name], grad, rtol=1e-5, atol=atol, msg=name)


def test_npu_swiglu_takes_one_gate_up_projection_not_a_cat_of_activations(monkeypatch):
    """Each MLP's gate and up come from one matmul of their weights: what ``npu_swiglu``
    gets was made by that projection (no ``CatBackward0``), with the reference's values and
    gradients (``test_each_fused_op_gives_the_references_values_and_gradients``)."""
    monkeypatch.setattr(test_kernels, "SWIGLU_INPUTS", [])
    kernels = choose_kernels(_here(TORCH_NPU))
    reference, fused = _tiny(), _tiny()
    kernels.apply(fused)
    _equal(_run(fused), _run(reference))
    layers = fused.config.num_hidden_layers
    # two forwards (the logits, the lean path's log-probs), one call per layer each
    assert test_kernels.SWIGLU_INPUTS == ["_GateUpBackward"] * 2 * layers
    assert kernels.chosen == _fused(TORCH_NPU), kernels.reasons


def test_an_mlp_with_an_adapter_on_gate_concatenates_its_outputs(monkeypatch):
    """A gate projection that is not a plain ``nn.Linear`` (an adapter wraps it) runs its own
    forward: its output and up's are concatenated for ``npu_swiglu``."""

    class Adapted(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 1.5

    def adapt(model):
        for layer in model.model.layers:
            old = layer.mlp.gate_proj
            new = Adapted(old.in_features, old.out_features, bias=False)
            new.weight = old.weight
            layer.mlp.gate_proj = new
        return model

    monkeypatch.setattr(test_kernels, "SWIGLU_INPUTS", [])
    kernels = choose_kernels(_here(TORCH_NPU))
    reference, fused = adapt(_tiny()), adapt(_tiny())
    kernels.apply(fused)
    _equal(_run(fused), _run(reference))
    assert set(test_kernels.SWIGLU_INPUTS) == {"CatBackward0"}


@pytest.mark.parametrize("providers", [TORCH_NPU, LIGER], ids=["torch_npu", "liger"])
def test_a_scaled_rope_keeps_the_reference_where_the_kernel_takes_unit_cos_sin(providers):
    """``attention_scaling`` 1.5 scales cos and sin beyond [-1, 1], the range torch_npu
    documents for ``npu_rotary_mul``'s r1 and r2: the NPU keeps the reference rotation, said
    in the report, nothing falls back at run time; Liger's rope takes any cos and sin."""

    def scaled(model):
        model.model.rotary_emb.attention_scaling = 1.5
        return model

    kernels = choose_kernels(_here(providers))
    reference, fused = scaled(_tiny()), scaled(_tiny())
    patched = kernels.apply(fused)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _equal(_run(fused), _run(reference))
    assert [w for w in caught if issubclass(w.category, RuntimeWarning)] == []
    if providers is TORCH_NPU:
        assert patched["rope"] == 0 and kernels.chosen["rope"] == REFERENCE
        assert "attention_scaling=1.5" in kernels.report()["rope"]
    else:
        assert patched["rope"] > 0 and kernels.chosen["rope"] == LIGER["rope"].name
