"""The GPU-scale models the simulator's benchmarks trace (issue 16), built on the meta device: no
weights are ever allocated. Each ``*_step`` returns ``(step, meta)``: ``step()`` runs one training
step (forward, loss, backward, AdamW), ``meta`` says what it is.

  gpt2-xl    GPT-2 XL-sized decoder: 48 layers, d 1600, 25 heads, seq 1024, vocab 50257
  llama-7b   Llama-style stack: 32 layers, d 4096, 32 heads, SwiGLU 11008, RMSNorm, RoPE, seq 2048, vocab 32000
  resnet152  ResNet-152 (bottlenecks 3-8-36-3) on 224x224 images, 1000 classes
  hf:TYPE    a Hugging Face ``transformers`` model of config type TYPE ("gpt2", "llama", ...) with its
             default config, or hf:PATH with PATH a config.json: random weights, nothing downloaded

Parameters and compute are in ``dtype`` (bf16 by default: how these train on an H100). Attention is
the flash kernel's op (``aten._scaled_dot_product_flash_attention``), as on a GPU: no seq x seq
matrix is kept.
"""
from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

META = torch.device("meta")


def _flash(q, k, v):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True)[0]


class _GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(_flash(q, k, v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_GPTBlock(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class _RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class _LlamaBlock(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = _RMSNorm(d), _RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = _flash(_rotate(q, cos, sin), _rotate(k, cos, sin), v)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, hidden: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_LlamaBlock(d, heads, hidden) for _ in range(layers))
        self.norm = _RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        half = d // heads // 2
        freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        angle = torch.outer(torch.arange(seq, dtype=torch.float32), freq)
        self.register_buffer("cos", torch.cat((angle.cos(), angle.cos()), -1), persistent=False)
        self.register_buffer("sin", torch.cat((angle.sin(), angle.sin()), -1), persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        cos, sin = self.cos[:t].to(self.emb.weight.dtype), self.sin[:t].to(self.emb.weight.dtype)
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.c1, self.b1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.c2, self.b2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.c3, self.b3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)))
        y = self.b3(self.c3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, blocks=(3, 8, 36, 3), classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for i, n in enumerate(blocks):
            width = 64 * 2 ** i
            for j in range(n):
                layers.append(_Bottleneck(cin, width, 2 if j == 0 and i > 0 else 1))
                cin = 4 * width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def _trainer(model: nn.Module, batch_fn: Callable, loss_fn: Callable) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    data = batch_fn()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model, *data).backward()
        opt.step()

    step.optimizer = opt
    return step


def _lm_loss(model, idx):
    logits = model(idx)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx.reshape(-1))


def gpt2_xl_step(batch: int = 8, seq: int = 1024, dtype=torch.bfloat16, layers: int = 48, d: int = 1600,
                 heads: int = 25, vocab: int = 50257):
    with META:
        model = GPT(layers, d, heads, seq, vocab).to(dtype)
    step = _trainer(model, lambda: (torch.randint(0, vocab, (batch, seq), device=META),), _lm_loss)
    return step, dict(model="gpt2-xl", layers=layers, d=d, heads=heads, seq=seq, vocab=vocab, batch=batch)


def llama_7b_step(batch: int = 1, seq: int = 2048, dtype=torch.bfloat16, layers: int = 32, d: int = 4096,
                  heads: int = 32, hidden: int = 11008, vocab: int = 32000):
    with META:
        model = Llama(layers, d, heads, hidden, seq, vocab).to(dtype)
    step = _trainer(model, lambda: (torch.randint(0, vocab, (batch, seq), device=META),), _lm_loss)
    return step, dict(model="llama-7b", layers=layers, d=d, heads=heads, hidden=hidden, seq=seq, vocab=vocab,
                      batch=batch)


def resnet152_step(batch: int = 64, size: int = 224, dtype=torch.bfloat16, blocks=(3, 8, 36, 3)):
    with META:
        model = ResNet(blocks).to(dtype)

    def data():
        return (torch.randn(batch, 3, size, size, device=META, dtype=dtype),
                torch.randint(0, 1000, (batch,), device=META))

    step = _trainer(model, data, lambda m, x, y: F.cross_entropy(m(x).float(), y))
    return step, dict(model="resnet152", blocks=list(blocks), image=size, batch=batch)


def hf_step(config: str, batch: int = 1, seq: int = 1024, dtype=torch.bfloat16):
    """A causal LM from a transformers config: a model type's defaults, or a config.json path."""
    try:
        import transformers
    except ImportError:
        raise ValueError("hf: models need the transformers package (pip install transformers)") from None
    if config.endswith(".json"):
        cfg = transformers.AutoConfig.from_pretrained(config)
    else:
        try:
            cfg = transformers.AutoConfig.for_model(config)
        except ValueError:
            raise ValueError(f"unknown transformers model type {config!r}; accepted: a model type such as "
                             f"gpt2, llama, mistral, or a path to a config.json") from None
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or seq
    seq = min(seq, limit)
    with META:
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(dtype)
    vocab = cfg.vocab_size

    def loss(m, idx):
        return m(input_ids=idx, labels=idx).loss

    step = _trainer(model, lambda: (torch.randint(0, vocab, (batch, seq), device=META),), loss)
    return step, dict(model=f"hf:{config}", seq=seq, vocab=vocab, batch=batch)


BUILTIN: Dict[str, Callable[..., Tuple[Callable, Dict]]] = {
    "gpt2-xl": gpt2_xl_step, "llama-7b": llama_7b_step, "resnet152": resnet152_step}


def parameter_count(step) -> int:
    return sum(p.numel() for g in step.optimizer.param_groups for p in g["params"])


def model_step(name: str, batch=None, dtype=torch.bfloat16):
    """(step, meta) of a built-in model or hf:CONFIG; ``batch`` None: the model's default."""
    kw = {"dtype": dtype} if batch is None else {"dtype": dtype, "batch": batch}
    if name.startswith("hf:"):
        return hf_step(name[3:], **kw)
    fn = BUILTIN.get(name)
    if fn is None:
        raise ValueError(f"unknown model {name!r}; accepted: {', '.join(BUILTIN)}, hf:TYPE, hf:PATH/config.json, "
                         f"or a training script (.py)")
    step, meta = fn(**kw)
    meta["parameters"] = parameter_count(step)
    meta["dtype"] = str(dtype).replace("torch.", "")
    return step, meta

