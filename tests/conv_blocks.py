"""A conv + BatchNorm + ReLU + max-pool block with a residual, as a ResNet's stem, and its
gradients: the training-step model of the channels-last and native pooling tests."""
from __future__ import annotations

import torch
from torch import nn


class ConvBnPoolBlock(nn.Module):
    """``stem`` is the first convolution's (kernel, stride, padding)."""

    def __init__(self, cin=3, c=5, stem=(3, 1, 1)):
        super().__init__()
        self.conv = nn.Conv2d(cin, c, *stem, bias=False)  # a bias before BN gets ~0 grads
        self.bn = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 3, 2, 1)
        return torch.relu(self.bn2(self.conv2(y)) + y).sum(dim=(2, 3)).square().mean()


def loss_and_grads(model, x):
    """(loss, the input's grad, the parameters' grads) of one backward."""
    x = x.detach().clone().requires_grad_(True)
    loss = model(x)
    loss.backward()
    return loss, x.grad, [p.grad for p in model.parameters()]
