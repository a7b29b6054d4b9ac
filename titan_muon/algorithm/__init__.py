"""Muon's per-matrix math in its fast forms: Newton–Schulz (newton_schulz.py), the owners'
orthogonalization of a batch (orthogonalizer.py) and the element-wise rules (update.py).
muon_math.py states what they compute."""
