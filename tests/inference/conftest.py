"""Shared fixture of the inference tests; modules opt in with `pytestmark = pytest.mark.usefixtures("no_grad")`."""

import pytest
import torch


@pytest.fixture
def no_grad():
    with torch.no_grad():
        yield
