"""torchtitan 0.2.x only: train specs, ``build_optimizers_fn``, the trainer and the pipeline loss."""
