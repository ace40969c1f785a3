"""``transformers`` models (random weights, built from small configs; nothing is downloaded) train
under ``pymem.enable`` bit for bit as without it, within the budget.

Each model trains STEPS AdamW steps unmanaged (PyTorch's own allocator), then under 50% and 40% of
its unmanaged peak (every CPU tensor of the same steps served by a lazily mapped arena with no small
region, model and optimizer built under it too). Every loss and every parameter and buffer (BatchNorm
running stats included) must equal the unmanaged run's bytes, the arena's peak must stay within the
budget, and pymem must really have evicted. Dropout is on (training mode) in GPT-2, BERT and ViT, so
seeded ops are recomputed with their original generator state.

Which values pymem releases follows each op's cost. Measured costs (the CPU's default) vary from run
to run, and so does whether any dropout mask is recomputed: on one CI run GPT-2 at 0.5 recomputed
none. So at the lower ratio the dropout models run with fixed rates (``FIXED_RATES``), which release
the same values on every machine, and there a mask must have been recomputed; so does ResNet at its
low point (``LOW_RATIO``).

The configs are shaped so that activations dominate: the leaves (parameters, gradients, AdamW
state, the batch) plus the working set of a recompute fit in 40% of the peak. A model whose leaves
alone exceed the budget cannot train at all: ``test_leaves_over_budget_raise_out_of_budget`` checks
that this ends in pymem's clear OutOfBudgetError rather than a crash or a silent overrun.
"""
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import pymem  # noqa: E402
from pymem.cost_model import CostModel  # noqa: E402
from bitwise_harness import (assert_bitwise_equal, assert_within_budget, budget_at, measure,  # noqa: E402
                             run_managed, run_unmanaged)

transformers.utils.logging.set_verbosity_error()

pytestmark = pytest.mark.slow

STEPS = 3
RATIOS = (0.5, 0.4)
# The CPU's convolution backward kernels allocate workspaces inside one op that pymem cannot release,
# and their size varies with the CPU and its thread count: on one 2-core machine ResNet's lowest
# feasible budget was 0.42 of its peak with 1-2 threads and above it with 4. Its low point is 0.45,
# at fixed rates: with measured costs, on a loaded 2-core machine (another process on one core), 3 of
# 8 runs there, before and after 2026-11-28's pressure changes alike, recomputed the first
# convolution in backward beside two gradients, where its 1 MiB oneDNN workspace left no room.
LOW_RATIO = {"resnet": 0.45}
B, T, V, D, L = 16, 64, 64, 32, 4  # batch, sequence, vocabulary, width, layers
# Roughly this CPU's rates; what matters is that they are fixed. At 0.4 they recompute 27-31 masks in
# GPT-2, BERT and ViT (3 steps).
FIXED_RATES = CostModel(flop_rate=20e9, byte_rate=10e9, launch=5e-6)


def _gpt2(tf):
    cfg = tf.GPT2Config(vocab_size=V, n_positions=T, n_embd=D, n_layer=L, n_head=2,
                        bos_token_id=0, eos_token_id=0)  # dropout: resid, embd, attn 0.1 (defaults)
    model = tf.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, V, (B, T))
    return model, lambda: model(input_ids=ids, labels=ids).loss


def _bert(tf):
    cfg = tf.BertConfig(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=2,
                        intermediate_size=4 * D, max_position_embeddings=T, pad_token_id=0)  # dropout 0.1
    model = tf.BertForMaskedLM(cfg)
    ids = torch.randint(1, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[::2, T - 8:] = 0                     # padding: a real attention mask
    ids[::2, T - 8:] = 0
    labels = ids.clone()
    labels[:, ::2] = -100                     # only some positions are predicted
    labels[mask == 0] = -100
    return model, lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss


def _llama(tf):
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=L,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=T,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = tf.LlamaForCausalLM(cfg)
    ids = torch.randint(0, V, (B, T))
    return model, lambda: model(input_ids=ids, labels=ids).loss


def _vit(tf, hidden=D, layers=L, patch=4, batch=B):
    cfg = tf.ViTConfig(image_size=32, patch_size=patch, num_channels=3, hidden_size=hidden,
                       num_hidden_layers=layers, num_attention_heads=2, intermediate_size=2 * hidden,
                       num_labels=10, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = tf.ViTForImageClassification(cfg)
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    return model, lambda: model(pixel_values=x, labels=y).loss


def _resnet(tf):
    cfg = tf.ResNetConfig(num_channels=3, embedding_size=4, hidden_sizes=[16, 16], depths=[3, 1],
                          layer_type="basic", num_labels=10, downsample_in_first_stage=False)
    model = tf.ResNetForImageClassification(cfg)  # BatchNorm in training mode: running stats update
    x = torch.randn(B, 3, 64, 64)
    y = torch.randint(0, 10, (B,))
    return model, lambda: model(pixel_values=x, labels=y).loss


def _vit_tiny_batch(tf):
    """A ViT whose parameters and AdamW state outweigh its activations (leaves ~60% of the peak)."""
    return _vit(tf, hidden=32, layers=2, patch=8, batch=8)


MODELS = {"gpt2": _gpt2, "bert": _bert, "llama": _llama, "vit": _vit, "resnet": _resnet}
WITH_DROPOUT = ("gpt2", "bert", "vit")


def workload(name):
    build = {**MODELS, "vit-tiny-batch": _vit_tiny_batch}[name]

    def make():
        torch.manual_seed(0)
        model, loss_fn = build(transformers)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn()
            loss.backward()
            opt.step()
            return loss.detach().clone()

        step.model = model
        return step
    return make


_MEASURED = {}


def measured(name):
    """(peak, resident, unmanaged run) of ``name``, once per session."""
    if name not in _MEASURED:
        peak, resident = measure(workload(name), STEPS)
        _MEASURED[name] = (peak, resident, run_unmanaged(workload(name), STEPS))
    return _MEASURED[name]


@pytest.fixture
def seeded_recomputes(monkeypatch):
    """The ops of every recompute that replayed a generator state (dropout's bernoulli_, randn ...)."""
    from pymem.runtime import remat

    seen = []
    call = remat._call

    def counting(rc, args, kwargs):
        if rc.rng is not None:
            seen.append(str(rc.func))
        return call(rc, args, kwargs)

    monkeypatch.setattr(remat, "_call", counting)
    return seen


def test_dropout_is_on():
    """Guards the workloads: dropout really runs (training mode, p > 0) where the docstring says so."""
    for name in WITH_DROPOUT:
        torch.manual_seed(0)
        model, _ = MODELS[name](transformers)
        model.train()
        drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        assert drops and all(m.training for m in drops), name


@pytest.mark.parametrize("name, ratio", [(n, r if r != min(RATIOS) else LOW_RATIO.get(n, r))
                                         for r in RATIOS for n in MODELS])
def test_hf_model_trains_bitwise_under_budget(name, ratio, record_property, seeded_recomputes):
    peak, resident, (ref_losses, ref_state, ref_s) = measured(name)
    budget = budget_at(peak, ratio)
    # Every config here is shaped so that the leaves fit with room to recompute; were that to change,
    # the run would have to end in OutOfBudgetError instead (see the test below), not train.
    assert resident < 0.3 * peak, f"{name}: leaves {resident} B of a {peak} B peak"
    dropout = name in WITH_DROPOUT and ratio == min(RATIOS)
    fixed = dropout or ratio == LOW_RATIO.get(name)
    losses, state, stats, seconds, _ = run_managed(workload(name), STEPS, budget, limit_s=120,
                                                   cost=FIXED_RATES if fixed else None)
    assert_bitwise_equal(f"{name} at {ratio}: losses", ref_losses, losses)
    assert_bitwise_equal(f"{name} at {ratio}: parameters and buffers", ref_state, state)
    assert_within_budget(stats, budget)
    assert stats["num_evictions"] > 0 and stats["num_rematerializations"] > 0, stats
    if dropout:  # dropout masks were recomputed, from the generator state they first used
        assert any("bernoulli" in op for op in seeded_recomputes), seeded_recomputes
    record_property("slowdown", round(seconds / ref_s, 2))
    record_property("num_evictions", stats["num_evictions"])


def test_leaves_over_budget_raise_out_of_budget():
    """Infeasible on purpose: this ViT's leaves (parameters, gradients, AdamW state, batch) exceed 40%
    of its peak, and pymem never releases leaves, so no schedule fits. The run must stop with pymem's
    OutOfBudgetError naming the budget (not exceed it, crash or hang), and disable() must still
    leave every tensor valid."""
    peak, resident = measure(workload("vit-tiny-batch"), STEPS)
    budget = budget_at(peak, 0.4)
    assert resident > budget, (resident, budget)
    with pytest.raises(pymem.OutOfBudgetError, match=f"the budget is {budget} B"):
        run_managed(workload("vit-tiny-batch"), STEPS, budget, limit_s=120)
    assert not pymem.is_enabled()
