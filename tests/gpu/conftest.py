import pytest
import torch

import primemoe


@pytest.fixture(autouse=True)
def no_device_error_left_behind():
    """Every GPU test must leave no unreported kernel error behind (it would leak into the next test)."""
    yield
    if torch.cuda.is_available():
        primemoe.check_errors()
