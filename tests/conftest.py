"""Fixtures every test gets, and the one GPU marker: a test marked `gpu` (or
`gpu(capability=9)`, a Hopper or newer GPU) is skipped where there is none, and shows as
skipped rather than disappearing. Shared helpers live in tests/support."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = marker.kwargs.get("capability", 0)
        if not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        elif torch.cuda.get_device_capability()[0] < need:
            item.add_marker(pytest.mark.skip(reason=f"needs a GPU of compute capability {need}.0 or newer"))


@pytest.fixture(autouse=True)
def _exact_references():
    """References must not use TF32: cuDNN convs default to it, which alone is ~1e-3 error."""
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
