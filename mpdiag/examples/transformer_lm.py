"""Character-level transformer language model on scikit-learn's dataset documentation (English prose).

A GPT-style decoder (token + position embeddings, pre-LayerNorm blocks with causal self-attention and a
4x MLP). Loss falls from about 4.5 (ln 92) towards 2.5 in 200 steps. The default size is small because
CPUs have no fast FP16 matrix multiply: under O1 on a CPU each step is several times slower than in FP32
(the numerics are the same as on a GPU, only the speed is not). ``make_model`` builds larger variants
(the overhead benchmark uses ~9M parameters).
"""

import torch
from torch import nn
from torch.nn import functional as F

from mpdiag.examples.data import sklearn_docs_text


class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharTransformer(nn.Module):
    def __init__(self, vocab, context, d_model, n_layers, n_heads):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def encoded_text(device):
    text = sklearn_docs_text()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index[c] for c in text], dtype=torch.int64, device=device), len(vocab)


def make_model(vocab, context=64, d_model=64, n_layers=2, n_heads=4):
    return CharTransformer(vocab, context, d_model, n_layers, n_heads)


def build(device, context=64, batch_size=24, **size):
    data, vocab = encoded_text(device)
    model = make_model(vocab, context=context, **size)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))

    def batches(step):
        starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=generator).to(device)
        offsets = starts[:, None] + torch.arange(context + 1, device=device)
        window = data[offsets]
        return window[:, :-1], window[:, 1:]

    def loss_fn(model, batch):
        inputs, targets = batch
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    return {
        "name": "char transformer LM",
        "description": "GPT-style character model on scikit-learn's dataset docs.",
        "model": model,
        "optimizer": lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01),
        "batches": batches,
        "loss_fn": loss_fn,
    }
