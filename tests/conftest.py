import pytest
import torch

# Every test that takes `device` runs on the CPU and, where one exists, on the GPU; without a
# GPU the CUDA cases show up as skipped rather than disappearing.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.fixture(autouse=True)
def _exact_references():
    """References must not use TF32: cuDNN convs default to it, which alone is ~1e-3 error."""
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def poison_allocator(device, numel, dtype):
    """Leave a NaN-filled block of the output's size in the allocator's free list, so that an
    op allocating its output there and failing to write an element shows NaN."""
    torch.full((numel,), float("nan"), dtype=dtype, device=device)
