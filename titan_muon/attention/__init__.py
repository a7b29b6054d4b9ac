"""Attention-aware Muon: finding the attention layers, MuonClip (QK-clip) and Split."""
