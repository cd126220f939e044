#!/usr/bin/env python3
# torchdbg — module hooks and a training debugger for LibTorch.
# SPDX-License-Identifier: MIT
"""The bench's MLP monitored with plain PyTorch Python hooks computing the statistics
torchdbg's `full` mode computes (counts of NaN/Inf/zeros/negatives, mean and std of the
finite values, min, max, L1/L2/Linf norms) for every layer output, activation and parameter
gradient, every step. Baseline and monitored steps are interleaved in rounds; prints
`overhead mlp python-hooks: X%`. Run with Debian's python3-torch:
    /usr/bin/python3 bench/python_hooks_baseline.py [--threads 1] [--rounds 6] [--steps 20]
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def stats(t: torch.Tensor) -> dict:
    x = t.detach()
    finite = torch.isfinite(x)
    xf = torch.where(finite, x, torch.zeros_like(x))
    n = finite.sum()
    mean = xf.sum() / n.clamp(min=1)
    std = (((xf - mean) * finite) ** 2).sum().div(n.clamp(min=1)).sqrt()
    big = torch.finfo(x.dtype).max
    out = torch.stack([
        n.to(torch.float64), torch.isnan(x).sum().double(), torch.isinf(x).sum().double(),
        (x == 0).sum().double(), (xf < 0).sum().double(), mean.double(), std.double(),
        torch.where(finite, x, torch.full_like(x, big)).min().double(),
        torch.where(finite, x, torch.full_like(x, -big)).max().double(),
        xf.abs().sum().double(), xf.norm().double(), xf.abs().max().double(),
    ])
    return out.tolist()  # one host transfer per tensor, as a Python user would do


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(784, 512)] + [nn.Linear(512, 512) for _ in range(6)])
        self.out = nn.Linear(512, 10)

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.out(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(128, 784)
    y = torch.randint(0, 10, (128,))
    log = []

    def step():
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        return (time.perf_counter() - t0) * 1e6

    def attach():
        handles = []
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear):
                def fwd(mod, inp, out, name=name):
                    log.append(stats(out))
                    log.append(stats(F.relu(out)))  # the activation after it, as torchdbg reports
                handles.append(m.register_forward_hook(fwd))
                for p in m.parameters():
                    handles.append(p.register_hook(lambda g: log.append(stats(g))))
        return handles

    for _ in range(3):
        step()
    base, mon = [], []
    for _ in range(a.rounds):
        base += [step() for _ in range(a.steps)]
        handles = attach()
        mon += [step() for _ in range(a.steps)]
        for h in handles:
            h.remove()
        log.clear()
    b, m = statistics.median(base), statistics.median(mon)
    print(f"overhead mlp python-hooks: {100.0 * (m - b) / b:.1f}%")
    print(f"(torch {torch.__version__}, baseline median {b:.0f} us, monitored {m:.0f} us)")


if __name__ == "__main__":
    main()
