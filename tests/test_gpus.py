"""GPU cost models as data (pymem/gpus.py): published rates priced as the runtime prices ops."""
import pytest
import torch

from pymem import gpus

aten = torch.ops.aten


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_a_large_matmul_is_compute_bound_at_the_tensor_core_rate():
    a, b = _meta(4096, 4096), _meta(4096, 4096)
    out = _meta(4096, 4096)
    t = gpus.gpu_cost_model("h100").seconds(aten.mm.default, (a, b), {}, [a, b], out)
    flops = 2 * 4096 ** 3
    assert flops / 989.5e12 > 3 * 4096 * 4096 * 2 / 3.35e12  # compute outweighs the bytes moved
    assert t == pytest.approx(gpus.LAUNCH_SECONDS + flops / 989.5e12)
    t32 = gpus.gpu_cost_model("h100", torch.float32).seconds(aten.mm.default, (a, b), {}, [a, b], out)
    assert t32 == pytest.approx(gpus.LAUNCH_SECONDS + flops / 67e12)


def test_an_elementwise_op_is_memory_bound_and_faster_on_h200():
    n = 10 ** 8
    x, y, out = _meta(n), _meta(n), _meta(n)
    moved = 3 * n * 2  # two bf16 inputs read, one written
    h100 = gpus.gpu_cost_model("h100").seconds(aten.add.Tensor, (x, y), {}, [x, y], out)
    h200 = gpus.gpu_cost_model("h200").seconds(aten.add.Tensor, (x, y), {}, [x, y], out)
    assert h100 == pytest.approx(gpus.LAUNCH_SECONDS + moved / 3.35e12)
    assert h200 == pytest.approx(gpus.LAUNCH_SECONDS + moved / 4.8e12) and h200 < h100


def test_host_links_per_direction():
    assert gpus.copy_seconds("h100", 64 * 10 ** 9) == pytest.approx(1.0)   # PCIe 5.0 x16
    assert gpus.copy_seconds("a100", 32 * 10 ** 9) == pytest.approx(1.0)   # PCIe 4.0 x16
    assert gpus.copy_seconds("gh200", 450 * 10 ** 9) == pytest.approx(1.0)  # NVLink-C2C
    assert gpus.gpu_names() == ["a100", "gh200", "h100", "h200", "l4"]


def test_unknown_gpus_and_dtypes_are_clear_errors():
    with pytest.raises(ValueError, match="unknown GPU 'v100'; accepted: a100, gh200, h100, h200, l4"):
        gpus.gpu_cost_model("v100")
    with pytest.raises(ValueError, match="no rate for dtype torch.int8; accepted: torch.bfloat16"):
        gpus.gpu_cost_model("h100", torch.int8)
