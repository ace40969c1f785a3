"""Five small CPU training workloads for the runtime tests (``test_runtime_training.py``).

``trainer(name, seed)`` builds a model, its ``torch.optim.Adam`` optimizer and a fixed batch, all
inside the call (so under ``pymem.enable`` every one of them lives in the arena), and returns a
``step()`` callable: one Adam step, returning the loss as a Python float. ``step.model`` is the
model. Everything is fixed by the seed: ``torch.manual_seed(seed)`` runs first, and the global RNG
is then consumed only by the steps themselves (dropout in "gpt"), identically in every run.

The shapes are chosen so that activations dominate the unmanaged peak: the leaves (parameters,
gradients, Adam state, the batch) plus the largest single op's working set fit in well under 30% of
it, so every budget ratio the tests use is feasible. Each step takes a few tens of milliseconds on
two CPU cores.

Workloads:

- ``mlp``: a narrow, deep-enough ReLU MLP on a large batch (classification).
- ``cnn``: conv / BatchNorm2d (training mode: running stats update every step) / ReLU / pooling,
  linear head.
- ``gpt``: ``pymem.demo_models.TinyGPT`` (dropout 0.1, causal SDPA), small dims.
- ``lstm``: ``torch.nn.LSTMCell`` unrolled in a Python loop, linear head on every step.
- ``views``: views (view/transpose/reshape/slicing/narrow/select/unbind) and in-place ops
  (``relu_``, ``add_``, ``mul_``, ``sub_``, ``clamp_``, in-place through a view) on intermediate
  activations.
"""
import gc

import torch
import torch.nn.functional as F
from torch import nn

NAMES = ("mlp", "cnn", "gpt", "lstm", "views")


# --------------------------------------------------------------------------------------- models

class MLP(nn.Module):
    def __init__(self, din=32, hidden=64, layers=4, classes=10):
        super().__init__()
        dims = [din] + [hidden] * (layers - 1)
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        for lin in self.hidden:
            x = F.relu(lin(x))
        return self.head(x)


class CNN(nn.Module):
    def __init__(self, c=16, classes=10):
        super().__init__()
        full_res = [nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        for _ in range(7):
            full_res += [nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        self.features = nn.Sequential(
            *full_res,
            nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1, bias=False), nn.BatchNorm2d(2 * c), nn.ReLU(),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1, bias=False), nn.BatchNorm2d(2 * c), nn.ReLU(),
            nn.AvgPool2d(2),
        )
        self.head = nn.Linear(2 * c * 8 * 8, classes)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


class LSTMNet(nn.Module):
    def __init__(self, din=16, hidden=64, classes=8):
        super().__init__()
        self.cell = nn.LSTMCell(din, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, xs):  # xs: (T, B, din) -> logits (T, B, classes)
        h = xs.new_zeros(xs.shape[1], self.cell.hidden_size)
        c = torch.zeros_like(h)
        outs = []
        for x in xs:  # unbind along time: views of the input
            h, c = self.cell(x, (h, c))
            outs.append(self.head(h))
        return torch.stack(outs)


class ViewBlock(nn.Module):
    """Views and in-place ops on intermediates. Every in-place op comes before autograd saves the
    tensor it modifies (or hits a tensor autograd never saves), so autograd accepts it."""

    def __init__(self, h):
        super().__init__()
        self.h = h
        self.inp = nn.Linear(h, 2 * h)
        self.mix = nn.Linear(h, h)

    def forward(self, x):  # (b, t, h) -> (b, t, h)
        b, t, h = x.shape
        z = self.inp(x)                                  # (b, t, 2h); addmm does not save its output
        z = z.view(b, t, 2, h).transpose(1, 2)           # (b, 2, t, h): a non-contiguous view
        u = z[:, 0].clone()                              # (b, t, h)
        u.mul_(0.5)                                      # scalar in-place ops save nothing
        u.add_(1.0)
        u.narrow(1, 0, t // 2).sub_(0.25)                # in place through a view of u
        u[:, :, : h // 4].mul_(2.0)                      # ... and through a basic-indexing slice
        u.relu_()                                        # saves its result: u is not written again
        g = torch.sigmoid(z[:, 1])                       # a view of the linear output; saves result
        w = u * g                                        # saves u and g
        w = w.transpose(1, 2).reshape(b, h * t).view(b, h, t).transpose(1, 2)   # reshape copies
        w = self.mix(w)                                  # saves its (contiguous) input
        w.add_(u)                                        # in place on an output nobody saved
        w.clamp_(-4.0, 4.0)                              # saves a mask of its input; w's last write
        first, second = w.split(t // 2, dim=1)           # views
        y = torch.cat([second.flip(1), first], 1)        # (b, t, h)
        return x + torch.tanh(y)


class Views(nn.Module):
    def __init__(self, din=16, h=64, blocks=4, classes=8):
        super().__init__()
        self.embed = nn.Linear(din, h)
        self.blocks = nn.Sequential(*[ViewBlock(h) for _ in range(blocks)])
        self.out = nn.Linear(h, classes)

    def forward(self, x):  # x: (B, T, din) -> logits (B, classes)
        x = self.blocks(self.embed(x))
        s = x.select(1, 0).clone()                       # (b, h)
        s.mul_(0.0)
        s.add_(x.sum(1))                                 # in place on a clone of a select view
        s.div_(x.shape[1])
        return self.out(s)


# ------------------------------------------------------------------------------------- trainers

def _classifier_step(model, opt, batch_fn, set_to_none=True):
    def step() -> float:
        opt.zero_grad(set_to_none=set_to_none)
        loss = batch_fn()
        loss.backward()
        opt.step()
        return loss.item()

    step.model = model
    step.opt = opt
    return step


def _make_mlp(seed):
    torch.manual_seed(seed)
    model = MLP(din=64, hidden=64, layers=16, classes=64)  # every activation, input and logit 1 MiB
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(4096, 64)
    y = torch.randint(0, 64, (4096,))
    return _classifier_step(model, opt, lambda: F.cross_entropy(model(x), y))


def _make_cnn(seed):
    torch.manual_seed(seed)
    model = CNN(c=16, classes=10)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(16, 3, 32, 32)
    y = torch.randint(0, 10, (16,))
    return _classifier_step(model, opt, lambda: F.cross_entropy(model(x), y))


def _make_gpt(seed):
    from pymem.demo_models import TinyGPT

    vocab, seq, batch = 128, 64, 32
    torch.manual_seed(seed)
    model = TinyGPT(vocab=vocab, d=32, heads=4, layers=4, seq=seq)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    idx = torch.randint(0, vocab, (batch, seq + 1))

    def loss_fn():
        logits = model(idx[:, :-1])
        return F.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))

    return _classifier_step(model, opt, loss_fn, set_to_none=False)


def _make_lstm(seed):
    torch.manual_seed(seed)
    model = LSTMNet(din=16, hidden=64, classes=8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xs = torch.randn(16, 256, 16)
    ys = torch.randint(0, 8, (16, 256))
    return _classifier_step(model, opt, lambda: F.cross_entropy(model(xs).reshape(-1, 8), ys.reshape(-1)))


def _make_views(seed):
    torch.manual_seed(seed)
    model = Views(din=16, h=64, blocks=6, classes=8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 64, 16)
    y = torch.randint(0, 8, (64,))
    return _classifier_step(model, opt, lambda: F.cross_entropy(model(x), y), set_to_none=False)


_FACTORIES = {"mlp": _make_mlp, "cnn": _make_cnn, "gpt": _make_gpt, "lstm": _make_lstm,
              "views": _make_views}


def trainer(name: str, seed: int = 0):
    """``step()`` -> loss (float): one Adam step of workload ``name``; ``step.model`` is the model."""
    return _FACTORIES[name](seed)


# -------------------------------------------------------------------------------------- helpers

def snapshot(model):
    """Detached copies of the parameters, then the buffers (BatchNorm running stats included)."""
    return ([p.detach().clone() for p in model.parameters()]
            + [b.detach().clone() for b in model.buffers()])


def run(name: str, steps: int, seed: int = 0):
    """(losses, parameter copies) of ``steps`` steps of ``name``."""
    step = trainer(name, seed)
    losses = [step() for _ in range(steps)]
    return losses, [p.detach().clone() for p in step.model.parameters()]


def measure(name, steps, seed=0):
    """(peak, current) bytes of every CPU tensor over a run of ``steps`` steps of ``name``."""
    return measure_run(lambda: trainer(name, seed), steps)


def measure_run(make, steps):
    """(peak, current) bytes of every CPU tensor over ``steps`` calls of ``make()``'s step (built under
    the hook too), measured with an 8 GiB lazily mapped host arena with no small region as the CPU
    allocator; ``current`` is what stays allocated after the last step while the step is alive (the
    leaves pymem never releases: parameters, gradients, optimizer state, the batch)."""
    import pymem

    arena = pymem.Arena(8 << 30, small_threshold=0)
    pymem.install_cpu_hook(arena)
    try:
        step = make()
        for _ in range(steps):
            step()
        stats = arena.stats()
    finally:
        pymem.uninstall_cpu_hook()
    del step
    gc.collect()
    return stats["allocated_bytes.peak"], stats["allocated_bytes.current"]


def unmanaged_peak(name, steps, seed=0):
    """Peak bytes of every CPU tensor of a run of ``steps`` steps (see ``measure``)."""
    return measure(name, steps, seed)[0]
