"""Momentum storage (fp32, bf16, fp8), owner-held momentum, and checkpoints."""
