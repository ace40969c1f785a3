"""The runtime on a GPU (allocator="native": the caching allocator capped at the budget; op costs
estimated, never host-timed). Skipped cleanly without CUDA; the CPU-testable logic of the cap is in
test_allocators.py."""
import pytest
import torch

import pymem
from pymem.demo_models import TinyGPT

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 4


def train(seed=0):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=256, d=128, heads=4, layers=4, seq=256).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 256, (16, 257), device="cuda")
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=False)
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.fixture
def deterministic():
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.use_deterministic_algorithms(prev)
    pymem.disable()


def test_native_cuda_training_is_bitwise_equal_at_half_the_peak(deterministic):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    ref_losses, ref_params = train()
    peak = torch.cuda.max_memory_reserved() - base
    torch.cuda.empty_cache()
    budget = base + peak // 2
    rt = pymem.enable(budget, device="cuda")
    assert rt.allocator == "native" and rt.cost_model is not None  # the CUDA defaults
    losses, params = train()
    stats = pymem.memory_stats()
    pymem.disable()
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    assert stats["reserved_bytes.peak"] <= budget
    assert stats["num_evictions"] > 0 and stats["num_rematerializations"] > 0, stats
