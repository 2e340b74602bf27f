"""What ``python -m pypto_inductor report`` reports on: a user's factory, a zoo model
or a built-in model, as (name, module, positional inputs)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch


class KwargsModel(torch.nn.Module):
    """Calls ``model(**kwargs)`` from positional tensors (what ``report()`` passes), with
    the non-tensor keyword arguments fixed."""

    def __init__(self, model: torch.nn.Module, kwargs: dict):
        super().__init__()
        self.model = model
        self.keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        self.fixed = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}

    def forward(self, *tensors):
        return self.model(**dict(zip(self.keys, tensors)), **self.fixed)


def load_target(target: str | None, transformers: str | None, builtin: str | None,
                backward: bool) -> tuple[str, object, tuple]:
    given = [x for x in (target, transformers, builtin) if x]
    if len(given) > 1:
        raise SystemExit("report: give one of FILE.py:FACTORY, --transformers NAME or --model")
    if transformers:
        from . import zoo

        model = zoo.build(transformers)
        batch = zoo.batch(transformers)
        if not backward:  # inference: no labels (no loss), no autograd graph
            batch.pop("labels", None)
            model.requires_grad_(False)
        return transformers, *_positional(model, batch)
    if target:
        return _from_file(target, backward)
    from . import models

    name = builtin or "transformer"
    model, inputs = models.build(name)
    return name, model, tuple(inputs)


def _positional(model, inputs) -> tuple[object, tuple]:
    if isinstance(inputs, dict):
        wrapper = KwargsModel(model, inputs)
        return wrapper, tuple(inputs[k] for k in wrapper.keys)
    if isinstance(inputs, torch.Tensor):
        return model, (inputs,)
    return model, tuple(inputs)


def _from_file(target: str, backward: bool) -> tuple[str, object, tuple]:
    path, sep, factory = target.rpartition(":")
    if not sep or not path or not factory:
        raise SystemExit(f"report: expected FILE.py:FACTORY (e.g. my_model.py:make), got "
                         f"{target!r}")
    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"report: no such file {str(file)!r}")
    name = f"_pypto_report_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise SystemExit(f"report: {str(file)!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise SystemExit(f"report: importing {str(file)!r} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, factory, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items()
                       if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == name)
        raise SystemExit(f"report: {str(file)!r} has no function {factory!r}"
                         + (f"; functions defined there: {', '.join(found)}" if found else ""))
    try:
        result = fn()
    except Exception as e:
        raise SystemExit(f"report: {factory}() failed: {type(e).__name__}: {e}") from e
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and callable(result[0])):
        raise SystemExit(f"report: {factory}() must return (model, example_inputs), got "
                         f"{type(result).__name__}")
    model, inputs = result
    if not isinstance(inputs, (tuple, list, dict, torch.Tensor)):
        raise SystemExit(f"report: {factory}()'s example_inputs must be a tuple of tensors or a "
                         f"dict of keyword arguments, got {type(inputs).__name__}")
    label = f"{file.stem}:{factory}"
    return label, *_positional(model, inputs)
