"""Parameters, gradients and a one-process run shared by the optimizer tests."""

import torch
from torch import nn

from titan_muon import Muon

SHAPES = {"a": (30, 64), "b": (63, 64), "c": (3, 256), "d": (64, 30), "e": (48, 48)}


def make_params(seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


def grads_for(step, params):
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in params.items()}


def run_titan(params, steps, muon_names, **kwargs):
    tensors = {n: nn.Parameter(p.clone()) for n, p in params.items()}
    muon = [(n, t) for n, t in tensors.items() if n in muon_names]
    adamw = [(n, t) for n, t in tensors.items() if n not in muon_names]
    groups = [g for g in ({"params": muon, "use_muon": True}, {"params": adamw, "use_muon": False}) if g["params"]]
    opt = Muon(groups, **kwargs)
    for s in range(steps):
        for n, g in grads_for(s, params).items():
            tensors[n].grad = g
        opt.step()
    return {n: t.detach() for n, t in tensors.items()}, opt


