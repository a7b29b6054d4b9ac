"""Muon's math: Newton–Schulz, the element-wise rules, the owners' work and the commit."""
