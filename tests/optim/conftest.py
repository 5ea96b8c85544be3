import pytest
import torch

from .tinynet import TinyNet


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return TinyNet()
