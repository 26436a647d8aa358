"""The trainer's test files share one fixture."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one thread is faster, and the CI machine's cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
