# Makes the TorchScript models test_jit.cpp attaches to, and what Python's own forward hooks
# record on the same eager models: each submodule call's output, and each parameter's gradient
# of loss = out.square().mean(). Also RANDOM_MODELS random models (random_<k>), written as
# Python source and imported, with the deliveries each must make. Usage: make_models.py OUT_DIR
import importlib.util
import os
import random
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


class AttentionTransposed(Attention):
    """The caller transposes MultiheadAttention's output (not its own reshape: not delivered so)."""

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.mha(h, h, h)
        return self.out(a.transpose(0, 1))


class AttentionToken(Attention):
    """One query token, batch of one; the caller squeezes the token dimension (0)."""

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.mha(h[:1], h, h)
        return self.out(a.squeeze(0))


class MyMultiheadAttention(nn.Module):
    """A user's attention: its class name ends like torch.nn's, its forward is its own."""

    def __init__(self, d=8):
        super().__init__()
        self.scale = nn.Parameter(torch.full((1,), 0.5))
        self.qkv = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        w = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return self.norm(self.out_proj(w @ v) + x) * self.scale


class UserAttention(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.attn = MyMultiheadAttention(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        return self.head(self.attn(self.inp(x)))


class Cells(nn.Module):
    """RNN cells: scripted, one operator each; traced, their gates (no output delivered)."""

    def __init__(self, d=8):
        super().__init__()
        self.gru = nn.GRUCell(d, d)
        self.lstm = nn.LSTMCell(d, d)
        self.rnn = nn.RNNCell(d, d)
        self.act = nn.Tanh()
        self.fc = nn.Linear(d, 2)

    def forward(self, x):
        h = self.gru(x)
        h, c = self.lstm(h)
        h = self.rnn(h + c)
        return self.fc(self.act(h))


class Gates(nn.Module):
    """Activation functions read a Linear's output (one through a view) before the activation
    module does: the module is not named, the first function is the delivery."""

    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.ReLU()
        self.g = nn.Linear(d, d)
        self.act2 = nn.ReLU()
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        y = self.fc(x)
        stat = torch.sigmoid(y.t()).mean()
        z = self.g(self.act(y))
        gate = torch.sigmoid(z)
        return self.out(self.act2(z) * gate) + stat


class Helper(nn.Module):
    """A parameter-free submodule that applies an activation to what it is given."""

    def forward(self, y):
        return torch.relu(y).mean()


class Hidden(Gates):
    """A Linear's output reaches an activation through a submodule and through detach beside
    the activation module: the module is not named (whichever runs first is the delivery)."""

    def __init__(self, d=8):
        super().__init__(d)
        self.helper = Helper()

    def forward(self, x):
        y = self.fc(x)
        s = self.helper(y)
        z = self.g(self.act(y))
        t = torch.relu(z.detach()).mean()
        return self.out(self.act2(z)) + s + t


class FiLM(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gamma = nn.Parameter(torch.randn(d))
        self.beta = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.gamma.view(1, -1) + self.beta.view(1, -1)


class CastLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


class LoopLayer(nn.Module):
    """Applies its weights once per iteration: no output of its own is delivered."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) * 0.3)
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        for _ in range(2):
            x = torch.tanh(x @ self.weight.t() + self.bias)
        return x


class SlopeAct(nn.Module):
    """Its output is made after its operator on its weight: no output of its own is delivered."""

    def __init__(self, d):
        super().__init__()
        self.slope = nn.Parameter(torch.full((d,), 0.1))

    def forward(self, x):
        return torch.relu(x) + self.slope * x


class Custom(nn.Module):
    """Layers that prepare their weights apart (views, casts) before applying them."""

    def __init__(self, d=8):
        super().__init__()
        self.film = FiLM(d)
        self.act = nn.ReLU()
        self.cast = CastLinear(d, d)
        self.act2 = nn.Tanh()
        self.loop = LoopLayer(d)
        self.leaky = SlopeAct(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        x = self.act(self.film(x))
        x = self.act2(self.cast(x))
        return self.head(self.leaky(self.loop(x)))


class Counter(nn.Module):
    """Freezing keeps the buffer its forward updates, and folds the Linears."""

    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x):
        self.calls += 1
        return torch.relu(self.fc(x))


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


class Named(nn.Module):
    """Activation modules: in a Sequential, after a view; one shared by two Linears and one
    after only one of a Linear's two calls (neither named)."""

    def __init__(self, d=8):
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.fc = nn.Linear(d, 2 * d)
        self.act = nn.Tanh()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.shared = nn.Sigmoid()
        self.c = nn.Linear(d, d)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        x = self.seq(x)
        x = self.act(self.fc(x).view(-1, 2, 8)).sum(1)
        x = self.shared(self.a(x)) + self.shared(self.b(x))
        x = self.act2(self.c(x))
        x = torch.relu(self.c(x))
        return self.head(x)


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


RANDOM_MODELS = 16
ACTIVATIONS = [("ReLU", "relu"), ("Tanh", "tanh"), ("Sigmoid", "sigmoid"), ("GELU", "gelu")]
# activation modules where only Python's hook is the reference (named deliveries)
MODULES = ACTIVATIONS + [("LeakyReLU", ""), ("SiLU", ""), ("Softmax", ""), ("ReLU6", ""), ("ELU", ""),
                         ("Hardswish", ""), ("Softplus", "")]


def random_source(rng, k):
    """A random model's class, as users write one, and the deliveries attach must make: a list
    of (delivery name, what Python recorded: "<module>" or "<function>:<module>")."""
    d = 8
    init, fwd, expect = [], [], []

    def act():
        return rng.choice(ACTIVATIONS)

    def module():
        cls = rng.choice(MODULES)[0]
        return cls + ("(dim=-1)" if cls == "Softmax" else "()")

    for i in range(rng.randint(3, 7)):
        kind = rng.choice(["act_module", "functional", "plain", "block", "twice", "shared", "norm", "view",
                           "loop", "sequential", "twice_functional", "dropout", "batchnorm", "gate"])
        if kind == "act_module":  # an activation module after a Linear: named
            init += ["self.l%d = nn.Linear(%d, %d)" % (i, d, d), "self.a%d = nn.%s" % (i, module())]
            fwd += ["x = self.a%d(self.l%d(x))" % (i, i)]
            expect += [("l%d" % i, "l%d" % i), ("a%d" % i, "a%d" % i)]
        elif kind == "functional":  # torch.<f> after a Linear: "<linear>/<f>"
            _, f = act()
            call = "torch.nn.functional.gelu" if f == "gelu" else "torch." + f
            init += ["self.l%d = nn.Linear(%d, %d)" % (i, d, d)]
            fwd += ["x = %s(self.l%d(x))" % (call, i)]
            expect += [("l%d" % i, "l%d" % i), ("l%d/%s" % (i, f), "%s:l%d" % (f, i))]
        elif kind == "plain":
            init += ["self.l%d = nn.Linear(%d, %d)" % (i, d, d)]
            fwd += ["x = self.l%d(x)" % i]
            expect += [("l%d" % i, "l%d" % i)]
        elif kind == "block":  # a residual block (one class, several instances)
            init += ["self.b%d = Block(%d)" % (i, d)]
            fwd += ["x = x + self.b%d(x)" % i]
            expect += [("b%d.fc" % i, "b%d.fc" % i), ("b%d.act" % i, "b%d.act" % i)]
        elif kind == "twice":  # one Linear and its activation module called twice: named
            init += ["self.l%d = nn.Linear(%d, %d)" % (i, d, d), "self.a%d = nn.%s" % (i, module())]
            fwd += ["x = self.a%d(self.l%d(x))" % (i, i)] * 2
            expect += [("l%d" % i, "l%d" % i), ("a%d" % i, "a%d" % i)]
        elif kind == "shared":  # one activation module after two Linears: not named
            cls, f = act()
            init += ["self.p%d = nn.Linear(%d, %d)" % (i, d, d), "self.q%d = nn.Linear(%d, %d)" % (i, d, d),
                     "self.s%d = nn.%s()" % (i, cls)]
            fwd += ["x = self.s%d(self.p%d(x)) + self.s%d(self.q%d(x))" % (i, i, i, i)]
            expect += [("p%d" % i, "p%d" % i), ("p%d/%s" % (i, f), "%s:p%d" % (f, i)),
                       ("q%d" % i, "q%d" % i), ("q%d/%s" % (i, f), "%s:q%d" % (f, i))]
        elif kind == "norm":
            init += ["self.n%d = nn.LayerNorm(%d)" % (i, d)]
            fwd += ["x = self.n%d(x)" % i]
            expect += [("n%d" % i, "n%d" % i)]
        elif kind == "view":  # the activation module takes a view of the Linear's output
            cls, _ = act()  # (not Softmax: its dim would differ on the view)
            init += ["self.l%d = nn.Linear(%d, %d)" % (i, d, d), "self.a%d = nn.%s()" % (i, cls)]
            fwd += ["x = self.a%d(self.l%d(x).view(-1, 2, %d)).reshape(-1, %d)" % (i, i, d // 2, d)]
            expect += [("l%d" % i, "l%d" % i), ("a%d" % i, "a%d" % i)]
        elif kind == "loop":  # a ModuleList loop with torch.tanh
            init += ["self.m%d = nn.ModuleList([nn.Linear(%d, %d) for _ in range(2)])" % (i, d, d)]
            fwd += ["for layer in self.m%d:" % i, "    x = torch.tanh(layer(x))"]
            expect += [("m%d.%d" % (i, j), "m%d.%d" % (i, j)) for j in range(2)]
            expect += [("m%d.%d/tanh" % (i, j), "tanh:m%d.%d" % (i, j)) for j in range(2)]
        elif kind == "twice_functional":  # one Linear called twice, a function after each
            _, f = act()
            call = "torch.nn.functional.gelu" if f == "gelu" else "torch." + f
            init += ["self.l%d = nn.Linear(%d, %d)" % (i, d, d)]
            fwd += ["x = %s(self.l%d(%s(self.l%d(x))))" % (call, i, call, i)]
            expect += [("l%d" % i, "l%d" % i), ("l%d/%s" % (i, f), "%s:l%d" % (f, i))]
        elif kind == "gate":  # a function also reads the Linear's output: the module is not named
            cls, f = act()
            init += ["self.l%d = nn.Linear(%d, %d)" % (i, d, d), "self.a%d = nn.%s()" % (i, cls)]
            fwd += ["y = self.l%d(x)" % i, "x = self.a%d(y) * torch.sigmoid(y)" % i]
            expect += [("l%d" % i, "l%d" % i), ("l%d/%s" % (i, f), "%s:l%d" % (f, i))]
        elif kind == "dropout":  # a parameter-free module that is no activation: no delivery
            init += ["self.l%d = nn.Linear(%d, %d)" % (i, d, d), "self.d%d = nn.Dropout(0.0)" % i]
            fwd += ["x = self.d%d(self.l%d(x))" % (i, i)]
            expect += [("l%d" % i, "l%d" % i)]
        elif kind == "batchnorm":
            cls, _ = act()
            init += ["self.l%d = nn.Linear(%d, %d)" % (i, d, d), "self.n%d = nn.BatchNorm1d(%d)" % (i, d),
                     "self.a%d = nn.%s()" % (i, cls)]
            fwd += ["x = self.a%d(self.n%d(self.l%d(x)))" % (i, i, i)]
            expect += [("l%d" % i, "l%d" % i), ("n%d" % i, "n%d" % i), ("a%d" % i, "a%d" % i)]
        else:  # a Sequential of Linear, activation module, Linear
            init += ["self.q%d = nn.Sequential(nn.Linear(%d, %d), nn.%s, nn.Linear(%d, %d))" % (i, d, d, module(), d, d)]
            fwd += ["x = self.q%d(x)" % i]
            expect += [("q%d.%d" % (i, j), "q%d.%d" % (i, j)) for j in range(3)]
    init += ["self.head = nn.Linear(%d, 3)" % d]
    fwd += ["return self.head(x)"]
    expect += [("head", "head")]
    src = "class Random%d(nn.Module):\n    def __init__(self):\n        super().__init__()\n" % k
    src += "".join("        %s\n" % line for line in init)
    src += "\n    def forward(self, x):\n" + "".join("        %s\n" % line for line in fwd) + "\n\n"
    return src, expect


def random_cases(out_dir, seed):
    """The random models, from a module of Python source written to OUT_DIR and imported
    (scripting reads a class's source)."""
    rng = random.Random(seed)
    src = ["import torch", "import torch.nn as nn", "", "",
           "class Block(nn.Module):",
           "    def __init__(self, d):",
           "        super().__init__()",
           "        self.fc = nn.Linear(d, d)",
           "        self.act = nn.ReLU()",
           "",
           "    def forward(self, x):",
           "        return self.act(self.fc(x))",
           "", ""]
    expects = []
    for k in range(RANDOM_MODELS):
        s, e = random_source(rng, k)
        src.append(s)
        expects.append(e)
    path = os.path.join(out_dir, "random_models.py")
    with open(path, "w") as f:
        f.write("\n".join(src))
    spec = importlib.util.spec_from_file_location("random_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {"random_%d" % k: (getattr(module, "Random%d" % k)(), torch.randn(4, 8), expects[k])
            for k in range(RANDOM_MODELS)}


def main(out_dir):
    torch.manual_seed(7)
    cases = {
        "net": (Net(), torch.randn(6, 8)),
        "attention": (Attention(), torch.randn(5, 2, 8)),
        "attention_bf": (AttentionBatchFirst(), torch.randn(2, 5, 8)),
        # an unbatched query; batch and sequence of one length (a transpose keeps the shape)
        "attention_ub": (Attention(), torch.randn(5, 8)),
        "attention_sq": (AttentionBatchFirst(), torch.randn(3, 3, 8)),
        "attention_t": (AttentionTransposed(), torch.randn(3, 3, 8)),
        "attention_tok": (AttentionToken(), torch.randn(6, 1, 8)),
        "user_attention": (UserAttention(), torch.randn(5, 8)),
        "cells": (Cells(), torch.randn(4, 8)),
        "gates": (Gates(), torch.randn(4, 8)),
        "hidden": (Hidden(), torch.randn(4, 8)),
        "custom": (Custom(), torch.randn(4, 8)),
        "encoder": (Encoder(), torch.randn(2, 5, 8)),
        "conv": (ConvNet(), torch.randn(3, 2, 5, 5)),
        "mlp": (Mlp(), torch.randn(16, 8)),
        "loop": (Loop(), torch.randn(4, 8)),
        "deep": (Deep(), torch.randn(4, 8)),
        "named": (Named(), torch.randn(4, 8)),
    }
    # frozen keeping a tensor: a buffer its forward updates, an attribute asked for
    torch.jit.freeze(torch.jit.script(Counter()).eval()).save(os.path.join(out_dir, "counter_frozen.pt"))
    torch.jit.freeze(torch.jit.script(Mlp()).eval(), preserved_attrs=["fc3"]).save(
        os.path.join(out_dir, "mlp_keep_frozen.pt"))
    cases = {name: (model, x, None) for name, (model, x) in cases.items()}
    cases.update(random_cases(out_dir, seed=int(os.environ.get("TORCHDBG_TEST_SEED", "11"))))
    for name, (model, x, expect) in cases.items():
        model.train()
        torch.jit.script(model).save(os.path.join(out_dir, name + "_scripted.pt"))
        torch.jit.trace(model, x, check_trace=False).save(os.path.join(out_dir, name + "_traced.pt"))
        if expect is None:
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
        for delivery, what in expect or []:  # the deliveries a random model must make
            flat["expect:%s=%s" % (delivery, what)] = torch.zeros(0)
        torch.save(flat, os.path.join(out_dir, name + "_ref.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
