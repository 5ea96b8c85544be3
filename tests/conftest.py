import pytest
import torch


@pytest.fixture
def float64_by_default():
    """Tight tolerances need float64; restored after each test so other tests keep float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
