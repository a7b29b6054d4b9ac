"""Muon and MuonClip for PyTorch FSDP2 and TorchTitan."""

from titan_muon.algorithm.newton_schulz import orthogonalize
from titan_muon.optimizer import Muon
from titan_muon.param_groups import build_param_groups

__all__ = ["Muon", "build_param_groups", "orthogonalize"]
