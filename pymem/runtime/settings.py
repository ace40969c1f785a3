"""What one ``pymem.enable`` asked for, checked in one place.

Every setting is validated here, with the error a user sees, before anything that cannot be undone
(on CUDA the arena's hook swaps PyTorch's allocator, which PyTorch never allows back). ``pymem.enable``
checks before it compares with the active runtime's settings; ``Runtime`` checks what it is given.
"""
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .. import _C
from ..choices import ALLOCATORS, COSTS, INTERCEPTS, PLANS
from ..cost_model import CostModel
from ..policies import Director, Policy, director_names, get_director, get_policy


def _accepted(values) -> str:
    return ", ".join(map(repr, values))


@dataclass(frozen=True)
class Settings:
    budget: int                       # bytes asked for (the runtime rounds down to the arena's grain)
    device: torch.device              # "cpu" or "cuda" / "cuda:N" (native: the index fixed now)
    allocator: str                    # one of ALLOCATORS
    policy: Policy                    # decides what to release
    director: Director                # decides, per released value, offload or evict
    prefetch: bool                    # offloaded values come back ahead of use (arena only)
    sampling: bool                    # DTR's candidate sampling
    cost: Union[str, CostModel]       # "measured", "estimate", or fixed rates
    link_bandwidth: Optional[float]   # bytes/s of a host copy; None: timed once per process
    intercept: str                    # one of INTERCEPTS: how ops reach the runtime
    plan: str = "auto"                # one of PLANS
    host_budget: Optional[int] = None # cap on the host pool's bytes (offloaded values); None: none
    offload_leaves: bool = False      # values with no recipe (gradients, optimizer state) offloadable
    verify: bool = False              # every value released is checked as it comes back (verify.py)

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"


def check_device(device, allocator: str) -> torch.device:
    """The runtime's device: the CPU, or one CUDA device. Under allocator="native", "cuda" is fixed
    to the current device here; under the arena that waits until the arena's hook has replaced
    PyTorch's CUDA allocator, which must come before anything initialises CUDA."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not accepted; accepted: 'cpu', 'cuda', 'cuda:N'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available here (no GPU visible, or a "
                             f"CPU-only torch build); use device='cpu'")
        if allocator == "native" and dev.index is None:  # the current device: fix it now, once
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def check_choices(policy="dtr", allocator: str = "arena", sampling: bool = False, cost=None, offload=None,
                  prefetch: bool = True, link_bandwidth=None, plan: str = "auto", offload_leaves=None,
                  verify: bool = False) -> None:
    """Every setting but the budget and the device, which need the device looked at (and on CUDA that
    must wait for pymem.enable's check of CUDA's initialisation order): a ValueError that names the
    bad one and what is accepted."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator {allocator!r} is not accepted; accepted: {_accepted(ALLOCATORS)}")
    if not isinstance(sampling, bool):
        raise ValueError(f"sampling must be True or False, got {sampling!r}")
    if not (cost is None or isinstance(cost, CostModel) or cost in COSTS):
        raise ValueError(f"cost {cost!r} is not accepted; accepted: None (by device), {_accepted(COSTS)}, "
                         f"or a pymem.cost_model.CostModel")
    if not (offload is None or isinstance(offload, Director) or offload in director_names()):
        raise ValueError(f"offload {offload!r} is not accepted; accepted: None (by device), "
                         f"{_accepted(director_names())}")
    if not isinstance(prefetch, bool):
        raise ValueError(f"prefetch must be True or False, got {prefetch!r}")
    if plan not in PLANS:
        raise ValueError(f"plan {plan!r} is not accepted; accepted: {_accepted(PLANS)}")
    if not isinstance(verify, bool):
        raise ValueError(f"verify must be True or False, got {verify!r}")
    if offload_leaves is not None and not isinstance(offload_leaves, bool):
        raise ValueError(f"offload_leaves must be None (by offload), True or False, got {offload_leaves!r}")
    if link_bandwidth is not None and not (isinstance(link_bandwidth, (int, float)) and link_bandwidth > 0):
        raise ValueError(f"link_bandwidth must be a positive number of bytes per second, got {link_bandwidth!r}")
    if not isinstance(policy, Policy):
        get_policy(policy)  # raises for an unknown name


def check_intercept() -> str:
    """How ops reach the runtime (interception.py): ``PYMEM_INTERCEPT`` if set, else the dispatcher
    where this torch takes pymem's fallback, and the mode where it does not (the same ops, slower)."""
    asked = os.environ.get("PYMEM_INTERCEPT")
    if asked is None:
        return "mode" if _C.install_interception() else "dispatcher"
    if asked not in INTERCEPTS:
        raise ValueError(f"PYMEM_INTERCEPT={asked!r} is not accepted; accepted: {_accepted(INTERCEPTS)}")
    if asked == "dispatcher":
        why = _C.install_interception()
        if why:
            raise ValueError(f"PYMEM_INTERCEPT='dispatcher': this torch refuses pymem's fallback on "
                             f"DispatchKey::Fake ({why}); unset it, or set it to 'mode'")
    return asked


def check(budget: int, policy="dtr", device="cpu", allocator: str = "arena", sampling: bool = False,
          cost=None, offload=None, prefetch: bool = True, link_bandwidth=None, plan: str = "auto",
          host_budget: Optional[int] = None, offload_leaves: Optional[bool] = None, verify: bool = False) -> Settings:
    """Settings from ``pymem.enable``'s arguments (the budget already in bytes), or a ValueError that
    names the bad one and what is accepted. ``policy`` / ``offload``: a name or an instance; ``cost``
    and ``offload`` None: by device (measured and never on the CPU, estimate and delta on CUDA)."""
    policy = policy if isinstance(policy, Policy) else get_policy(policy)
    check_choices(policy, allocator, sampling, cost, offload, prefetch, link_bandwidth, plan, offload_leaves, verify)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise ValueError(f"budget must be a positive int of bytes here, got {budget!r}")
    if host_budget is not None and (not isinstance(host_budget, int) or isinstance(host_budget, bool) or host_budget <= 0):
        raise ValueError(f"host_budget must be None or a positive int of bytes here, got {host_budget!r}")
    dev = check_device(device, allocator)
    on_cpu = dev.type == "cpu"
    if offload is None:
        offload = "never" if on_cpu else "delta"
    director = offload if isinstance(offload, Director) else get_director(offload)
    if offload_leaves is None:  # the lowest floor where anything is offloaded
        offload_leaves = director.name != "never"
    elif offload_leaves and director.name == "never":
        raise ValueError("offload_leaves=True needs offloading, but offload='never' offloads nothing; "
                         "set offload='delta' or 'always', or leave offload_leaves unset")
    if cost is None:
        cost = "measured" if on_cpu else "estimate"
    return Settings(budget=budget, device=dev, allocator=allocator, policy=policy, director=director,
                    prefetch=prefetch, sampling=sampling, cost=cost,
                    link_bandwidth=float(link_bandwidth) if link_bandwidth else None,
                    intercept=check_intercept(), plan=plan, host_budget=host_budget,
                    offload_leaves=offload_leaves, verify=verify)
