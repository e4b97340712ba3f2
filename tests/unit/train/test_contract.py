"""``check_model``: what it accepts and what it refuses, on every supported Python.

Python 3.12 changed ``isinstance`` against runtime-checkable Protocols to look members up
statically, which misses an ``nn.Module``'s submodules; these tests hold the check to the members
as the trainer reads them, for the real FOG and for models built to lack one member each.
"""

from __future__ import annotations

import types

import pytest
from torch import nn

from readback.backends import build_model
from readback.train.contract import RunNumerics, TrainableModel, check_model, protocol_members
from toys import TOY_RUN, ToyModel, ToyNumerics, config


def test_the_protocols_declare_the_members_the_trainer_reads():
    """An empty member list would let every model through: the derivation must see them all."""
    assert protocol_members(TrainableModel) == {
        "numerics": False,
        "layers": False,
        "n_params": True,
        "flops_per_token": True,
    }
    methods = {name for name, is_method in protocol_members(RunNumerics).items() if is_method}
    assert {"end_step", "check_scales", "state_dict", "load_state_dict", "isolated", "measuring"} <= methods
    assert protocol_members(RunNumerics)["sites"] is False


def test_the_real_fog_and_the_toy_model_pass():
    fog = build_model(config("data=synthetic", "model.n_layers=1", "model.vocab_size=256", *TOY_RUN), "cpu")
    assert check_model(fog) is fog
    toy = ToyModel(vocab=8)
    assert check_model(toy) is toy


def test_a_model_that_is_not_a_module_is_refused():
    toy = ToyModel(vocab=8)
    lookalike = types.SimpleNamespace(
        numerics=toy.numerics, layers=toy.layers, n_params=toy.n_params, flops_per_token=toy.flops_per_token
    )
    with pytest.raises(TypeError, match=r"SimpleNamespace is not an nn\.Module"):
        check_model(lookalike)


def test_a_module_without_layers_is_refused_by_name():
    toy = ToyModel(vocab=8)
    del toy.layers
    with pytest.raises(TypeError, match=r"ToyModel does not satisfy .*TrainableModel: it lacks layers$"):
        check_model(toy)


def test_a_member_that_is_not_callable_is_refused():
    toy = ToyModel(vocab=8)
    toy.n_params = 7  # type: ignore[assignment,method-assign]
    with pytest.raises(TypeError, match=r"it lacks n_params$"):
        check_model(toy)


def test_numerics_without_a_method_is_refused_with_its_path():
    class NoEndStep(ToyNumerics):
        end_step = None  # type: ignore[assignment]

    toy = ToyModel(vocab=8)
    toy.numerics = NoEndStep()
    with pytest.raises(TypeError, match=r"it lacks numerics\.end_step$"):
        check_model(toy)


def test_a_plain_module_lacks_everything_but_its_own_members():
    with pytest.raises(TypeError, match=r"it lacks numerics, layers, n_params, flops_per_token$"):
        check_model(nn.Linear(2, 2))
