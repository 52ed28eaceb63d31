"""The reference classifier, kept where more than one place checks against it.

`DigitsMLP`: notebook 02 defines its own in a cell and asserts it is this one (`str()` of both), so the house
model and the lesson cannot drift; tests/test_ddp_measure.py trains it. Notebook 04's script builds the same layers
as a plain `nn.Sequential`. The transformer is not here: every notebook and test that needs one uses the training
recipe's `GPT` (scripts/train/model.py, made of notebook 03's cells).
"""
from __future__ import annotations

from torch import nn


class DigitsMLP(nn.Module):
    def __init__(self, hidden: int = 256, depth: int = 2, n_in: int = 64, n_classes: int = 10):
        super().__init__()
        layers, width = [], n_in
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, n_classes)

    def forward(self, x):
        return self.head(self.body(x))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
