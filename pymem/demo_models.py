"""Small models for the demo and the benchmarks (CPU-sized)."""
import torch


class GPTBlock(torch.nn.Module):
    def __init__(self, d: int, heads: int, dropout: float = 0.1):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(torch.nn.Module):
    """A GPT-style decoder: token + position embedding, pre-norm blocks with dropout, a linear head."""

    def __init__(self, vocab: int = 512, d: int = 128, heads: int = 4, layers: int = 4, seq: int = 256):
        super().__init__()
        self.emb, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Parameter(torch.zeros(seq, d))
        self.blocks = torch.nn.Sequential(*[GPTBlock(d, heads) for _ in range(layers)])
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.blocks(self.emb(idx) + self.pos[: idx.shape[1]]))


def gpt_trainer(batch: int = 16, seq: int = 256, seed: int = 0, vocab: int = 512, device=None):
    """Returns step() -> loss (a float): one Adam step of TinyGPT on a fixed random batch, made on
    ``device`` (the default device when None)."""
    torch.manual_seed(seed)
    model = TinyGPT(vocab=vocab, seq=seq).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    idx = torch.randint(0, vocab, (batch, seq), device=device)

    def step() -> float:
        opt.zero_grad(set_to_none=False)
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        return loss.item()

    step.model = model
    return step


class WideMLP(torch.nn.Module):
    """A model dominated by its leaves: parameters, gradients and Adam state (16 bytes per parameter)
    are most of its peak, activations (a small batch) next to nothing."""

    def __init__(self, width: int = 1024, layers: int = 6):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.relu(layer(x))
        return x


def wide_trainer(width: int = 1024, layers: int = 6, batch: int = 16, seed: int = 0):
    """Returns step() -> loss: one Adam step of WideMLP on a fixed random batch (regression)."""
    torch.manual_seed(seed)
    model = WideMLP(width, layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width), torch.randn(batch, width)

    def step() -> float:
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    step.model = model
    return step
