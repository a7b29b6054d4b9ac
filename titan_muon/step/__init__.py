"""One optimizer step of the Muon matrices, above the exchange: the agreements every rank makes
(agreement.py), the per-matrix work of each round (matrix_step.py) and the commit of the
updates, momentum and AdamW's parameters (commit.py)."""
