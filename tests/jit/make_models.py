# Makes the TorchScript models test_jit.cpp attaches to, and what Python's own forward hooks
# record on the same eager models: each submodule call's output, and each parameter's gradient
# of loss = out.square().mean(). Usage: make_models.py OUT_DIR
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x)) + x


class Net(nn.Module):
    """Nested blocks, one called twice, a ModuleList loop, a functional tanh, BatchNorm."""

    def __init__(self, d=8):
        super().__init__()
        self.b0 = Block(d)
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.bn = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = self.b0(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        x = self.b0(x)
        x = self.bn(x)
        return self.head(x)


class Attention(nn.Module):
    """MultiheadAttention (its out_proj applied by its own forward) between two Linears."""

    def __init__(self, d=8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.mha = nn.MultiheadAttention(d, 2)
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.mha(h, h, h)
        return self.out(a)


class AttentionBatchFirst(Attention):
    """batch_first: in eval without gradients MultiheadAttention runs one fused operator."""

    def __init__(self, d=8):
        super().__init__(d)
        self.mha = nn.MultiheadAttention(d, 2, batch_first=True)


class Encoder(nn.Module):
    """A TransformerEncoderLayer: in eval without gradients it runs as one fused operator."""

    def __init__(self, d=8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layer = nn.TransformerEncoderLayer(d, 2, 16, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        return self.out(self.layer(self.inp(x)))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        return self.fc(x.flatten(1))


class Mlp(nn.Module):
    """What a C++ loop fine-tunes: Linears, a ReLU module and a functional tanh."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(self.act(self.fc1(x)))))


class Loop(nn.Module):
    """A submodule called three times in a TorchScript loop (tracing unrolls it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for _ in range(3):
            x = torch.relu(self.fc(x))
        return self.head(x)


class Deep(nn.Module):
    """Twelve Linears: more module tensors than the observer remembers derived tensors."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(12)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def record(model, x):
    outs, handles = {}, []
    for name, mod in model.named_modules():
        if not name:
            continue

        def hook(m, inp, out, name=name):
            if isinstance(out, tuple):
                out = out[0]
            outs.setdefault(name, []).append(out.detach().clone())

        handles.append(mod.register_forward_hook(hook))
    out = model(x)
    out.square().mean().backward()
    for h in handles:
        h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return outs, grads


def main(out_dir):
    torch.manual_seed(7)
    cases = {
        "net": (Net(), torch.randn(6, 8)),
        "attention": (Attention(), torch.randn(5, 2, 8)),
        "attention_bf": (AttentionBatchFirst(), torch.randn(2, 5, 8)),
        "encoder": (Encoder(), torch.randn(2, 5, 8)),
        "conv": (ConvNet(), torch.randn(3, 2, 5, 5)),
        "mlp": (Mlp(), torch.randn(16, 8)),
        "loop": (Loop(), torch.randn(4, 8)),
        "deep": (Deep(), torch.randn(4, 8)),
    }
    for name, (model, x) in cases.items():
        model.train()
        torch.jit.script(model).save(os.path.join(out_dir, name + "_scripted.pt"))
        torch.jit.trace(model, x, check_trace=False).save(os.path.join(out_dir, name + "_traced.pt"))
        frozen = torch.jit.freeze(torch.jit.script(model).eval())
        frozen.save(os.path.join(out_dir, name + "_frozen.pt"))
        outs, grads = record(model, x)
        # One flat dict of tensors (LibTorch's unpickler reads no nested lists).
        flat = {"x": x}
        for mod, calls in outs.items():
            for k, t in enumerate(calls):
                flat["out:%s:%d" % (mod, k)] = t
        for param, g in grads.items():
            flat["grad:" + param] = g
        torch.save(flat, os.path.join(out_dir, name + "_ref.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
