"""Momentum storage (fp32, bf16, fp8) on the shards, and momentum held by the owners."""
