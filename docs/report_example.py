"""An example model for ``python -m pypto_inductor report docs/report_example.py:make``.

A factory returns ``(model, example_inputs)``: inputs as a tuple of tensors, or a
dict of keyword arguments.
"""
import torch
import torch.nn as nn


class MLPBlock(nn.Module):
    def __init__(self, width: int = 64, hidden: int = 128):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(width, hidden), nn.LayerNorm(hidden), \
            nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.norm(self.up(x))))


def make():
    torch.manual_seed(0)
    return MLPBlock().eval(), (torch.randn(4, 16, 64),)
