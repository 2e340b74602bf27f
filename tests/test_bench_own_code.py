"""benchmarks.own_code: each compiled variant of one model behind a code object of its own
(the zoo, ab and conv benchmarks), so Dynamo does not look their frames up in one list."""
from __future__ import annotations

import inspect

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from benchmarks import own_code


def test_variants_of_one_module_get_a_code_object_and_a_frame_each():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    calls = {label: own_code(model) for label in ("inductor", "pypto")}
    assert calls["inductor"].__code__ is not calls["pypto"].__code__
    compiled = {label: torch.compile(f, backend=label) for label, f in calls.items()}
    for label, f in compiled.items():
        torch.testing.assert_close(f(x), model(x))
    for f in calls.values():
        assert len(_debug_get_cache_entry_list(f.__code__)) == 1


def test_a_wrapped_forward_keeps_its_signature():
    """transformers' generate inspects ``model.forward``'s parameters."""
    model = torch.nn.Linear(4, 4)
    wrapped = torch.compile(own_code(model.forward), backend="eager")
    assert inspect.signature(wrapped) == inspect.signature(model.forward)
    x = torch.randn(2, 4)
    torch.testing.assert_close(wrapped(input=x), model(x))  # keywords pass through
