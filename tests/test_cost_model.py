"""The FLOP/byte cost model (what the runtime prices ops with where a host timer cannot: CUDA)."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import pymem
from pymem import cost_model

aten = torch.ops.aten
MiB = 1 << 20


def counted_flops(fn):
    with FlopCounterMode(display=False) as m:
        fn()
    return m.get_total_flops()


@pytest.mark.parametrize("call", [
    lambda: torch.mm(torch.randn(64, 32), torch.randn(32, 48)),
    lambda: torch.addmm(torch.randn(48), torch.randn(64, 32), torch.randn(32, 48)),
    lambda: torch.bmm(torch.randn(3, 16, 8), torch.randn(3, 8, 5)),
    lambda: torch.nn.functional.conv2d(torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3), padding=1),
])
def test_flops_agree_with_torchs_flop_counter(call):
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.append(cost_model.op_flops(func, args, kwargs or {}, out))
            return out

    torch.manual_seed(0)
    expected = counted_flops(call)
    with Spy():
        call()
    assert expected > 0 and sum(seen) == expected


def test_cpu_attention_is_priced_like_flash_attention():
    q = torch.randn(2, 4, 64, 16)
    out = aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.0, True)
    expected = flop_registry[aten._scaled_dot_product_flash_attention](q, q, q, out_val=out)
    got = cost_model.op_flops(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, 0.0, True), {}, out)
    assert got == expected > 0


def test_estimate_is_a_roofline():
    m = cost_model.CostModel(flop_rate=1e9, byte_rate=1e9, launch=1e-6)
    x = torch.ones(1000)
    y = aten.add.Tensor(x, x)
    assert m.seconds(aten.add.Tensor, (x, x), {}, [x, x], y) == pytest.approx(1e-6 + 12000 / 1e9)
    a, b = torch.ones(100, 100), torch.ones(100, 100)
    c = aten.mm.default(a, b)
    assert m.seconds(aten.mm.default, (a, b), {}, [a, b], c) == pytest.approx(1e-6 + 2e6 / 1e9)  # FLOP-bound
    assert m.seconds(aten.relu.default, (x,), {}, [x], ()) == pytest.approx(1e-6 + 4000 / 1e9)  # no outputs


def test_calibration_is_timed_once_per_process_and_sane():
    m = cost_model.calibrated("cpu")
    assert cost_model.calibrated("cpu") is m
    assert 1e8 < m.flop_rate < 1e14 and 1e8 < m.byte_rate < 1e13 and 0 <= m.launch < 1e-3, m


@pytest.mark.parametrize("kw, text", [({"flop_rate": 0}, "flop_rate"), ({"byte_rate": -1}, "byte_rate"),
                                      ({"launch": float("nan")}, "launch")])
def test_bad_rates_are_refused(kw, text):
    args = {"flop_rate": 1e9, "byte_rate": 1e9, "launch": 0.0, **kw}
    with pytest.raises(ValueError, match=text):
        cost_model.CostModel(**args)


def test_runtime_prices_ops_with_the_given_model(managed):
    model = cost_model.CostModel(flop_rate=1e9, byte_rate=1e9, launch=1e-6)
    rt = pymem.enable(64 * MiB, cost=None)
    assert rt.cost_model is None  # measured on the CPU by default
    pymem.disable()
    rt = pymem.enable(64 * MiB, cost=model)
    assert rt.cost_model is model
    x = torch.ones(100_000)
    y = x * 2
    r = rt.table[pymem._C.storage_key(y)]
    assert r.compute_cost == pytest.approx(1e-6 + 800_000 / 1e9)


def test_a_cost_model_subclass_prices_views_at_its_launch_cost(managed):
    """A subclass's ``seconds`` runs on the Python path; a view op, which takes the C++ path under any
    model, is priced at the model's launch cost. Its measured time would advance the clock (which
    ages every value) by a different amount in every run, and the decisions would differ with it
    (bench/op_costs.py's MeasuredCosts: one recompute in a hundred, two runs of one process)."""
    class Halved(cost_model.CostModel):
        def seconds(self, func, args, kwargs, ins, out):
            return super().seconds(func, args, kwargs, ins, out) / 2

    rt = pymem.enable(64 * MiB, cost=Halved(flop_rate=1e9, byte_rate=1e9, launch=1e-3))
    x = torch.ones(100_000)
    y = x * 2
    assert rt.table[pymem._C.storage_key(y)].compute_cost == pytest.approx((1e-3 + 800_000 / 1e9) / 2)
    before, ops = rt.clock, rt.num_ops
    views = [y.view(-1) for _ in range(10)]
    assert rt.num_ops - ops == len(views)
    assert rt.clock - before == pytest.approx(len(views) * 1e-3)


def test_bad_cost_is_refused_and_changing_it_needs_disable(managed):
    with pytest.raises(ValueError, match="'timed'.*accepted: None \\(by device\\), 'measured', 'estimate', or a "
                                         "pymem.cost_model.CostModel"):
        pymem.enable(64 * MiB, cost="timed")
    assert not pymem.is_enabled()
    pymem.enable(64 * MiB, cost="estimate")
    assert pymem.enable(64 * MiB, cost="estimate") is pymem.current()
    with pytest.raises(RuntimeError, match="cost='estimate'.*cost='measured'"):
        pymem.enable(64 * MiB, cost="measured")
