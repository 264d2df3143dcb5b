"""A GAN as pytorch/examples' DCGAN trains one, with AMP as torch's AMP examples add it: the discriminator's
optimizer steps after its two backward passes, then the generator's after its own (which also writes
gradients into the discriminator's parameters, which no optimizer then uses).

Usage: gan_loop.py TRUTH_JSON [--iterations N]
The truth is the loop's own: per optimizer step (D, G, D, G, ...), the model that stepped, its unscaled loss
and its parameters' unscaled gradient L2 norms (GradScaler's scale read before the step).
"""

import argparse
import json

import torch
from torch import nn


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, x):
        return self.main(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("truth")
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    netG, netD = Generator(), Discriminator()
    criterion = nn.BCEWithLogitsLoss()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    truth = {"model": [], "loss": [], "norms": []}

    def note(name, net, loss):
        scale = scaler.get_scale()
        truth["model"].append(name)
        truth["loss"].append(loss)
        truth["norms"].append({f"{name}.{n}": (p.grad.double() / scale).norm().item() for n, p in net.named_parameters()})

    for _ in range(args.iterations):
        real = torch.randn(16, 8) * 0.5 + 1.0
        netD.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            errD_real = criterion(netD(real).float(), torch.ones(16, 1))
        scaler.scale(errD_real).backward()
        with torch.autocast("cpu", dtype=torch.float16):
            fake = netG(torch.randn(16, 4))
            errD_fake = criterion(netD(fake.detach()).float(), torch.zeros(16, 1))
        scaler.scale(errD_fake).backward()
        note("Discriminator", netD, errD_real.item() + errD_fake.item())
        scaler.step(optimizerD)
        netG.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            errG = criterion(netD(fake).float(), torch.ones(16, 1))
        scaler.scale(errG).backward()
        note("Generator", netG, errG.item())
        scaler.step(optimizerG)
        scaler.update()
    with open(args.truth, "w") as f:
        json.dump(truth, f)


if __name__ == "__main__":
    main()
