"""A tiny GPT trained the way nanoGPT's train.py trains (written for these tests, not copied): a model-defined
LayerNorm over F.layer_norm, tied embedding/output weights, configure_optimizers() returning AdamW with two
parameter groups (decay, no decay), a warmup+cosine learning rate set by hand on the groups, gradient
accumulation with loss / k, torch.amp.GradScaler(enabled=dtype == 'float16'), unscale_ then clip_grad_norm_.
Configured by --key=value arguments like nanoGPT's configurator. Writes what it computed itself (the norm
clip_grad_norm_ returned, the accumulated loss, the scaler's own scale) to --log as JSON."""

import json
import math
import sys
from contextlib import nullcontext

import torch
from torch import nn
from torch.nn import functional as F

config = dict(steps=6, accumulate=3, dtype="float16", lr=6e-3, warmup=2, grad_clip=1.0, n_embd=32, block=16,
              batch=4, vocab=50, log="nanogpt_log.json", autocast=1)
for arg in sys.argv[1:]:
    key, value = arg.removeprefix("--").split("=")
    config[key] = type(config[key])(value)


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias, as GPT codebases define it."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = LayerNorm(d, True), nn.MultiheadAttention(d, 2, batch_first=True), LayerNorm(d, True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln_1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab, d, block):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block, d),
                                              h=nn.ModuleList([Block(d), Block(d)]), ln_f=LayerNorm(d, True)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1])
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def get_lr(it):
    if it < config["warmup"]:
        return config["lr"] * (it + 1) / (config["warmup"] + 1)
    ratio = (it - config["warmup"]) / max(1, config["steps"] - config["warmup"])
    return config["lr"] * 0.1 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * config["lr"] * 0.9


torch.manual_seed(1337)
data = torch.randint(0, config["vocab"], (4000,))


def get_batch():
    ix = torch.randint(len(data) - config["block"] - 1, (config["batch"],))
    x = torch.stack([data[i:i + config["block"]] for i in ix])
    return x, torch.stack([data[i + 1:i + 1 + config["block"]] for i in ix])


model = GPT(config["vocab"], config["n_embd"], config["block"])
optimizer = model.configure_optimizers(0.1, config["lr"], (0.9, 0.95))
dtype = config["dtype"]
ctx = torch.autocast("cpu", dtype=getattr(torch, dtype)) if config["autocast"] and dtype != "float32" else nullcontext()
scaler = torch.amp.GradScaler("cpu", enabled=dtype == "float16")
log = {"grad_norm": [], "loss": [], "scale": [], "lr": []}

X, Y = get_batch()
for it in range(config["steps"]):
    lr = get_lr(it)
    for group in optimizer.param_groups:
        group["lr"] = lr
    total = 0.0
    for _ in range(config["accumulate"]):
        with ctx:
            loss = model(X, Y) / config["accumulate"]
        X, Y = get_batch()
        total += loss.item()
        scaler.scale(loss).backward()
    log["scale"].append(scaler.get_scale() if scaler.is_enabled() else 1.0)
    if config["grad_clip"] != 0.0:
        scaler.unscale_(optimizer)
        log["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), config["grad_clip"])))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    log["loss"].append(total)
    log["lr"].append(lr)
    print(f"iter {it}: loss {total:.4f}, lr {lr:.2e}")

with open(config["log"], "w") as f:
    json.dump(log, f)
