"""titan_muon's torchtitan 0.3.0 adapter.

torchtitan 0.3.0 reads no TOML: a run is ``--module M --config F``, where ``F`` returns a
``Trainer.Config``, and components are swapped by subclassing their nested ``Config``. Here:

* ``optimizer``: :class:`MuonOptimizersContainer` (its ``Config`` carries the ``[optimizer]``
  keys of titan_muon.torchtitan.config) and the override ``muon`` that turns any stock
  recipe's optimizer into it: ``--override.imports titan_muon.torchtitan.v030.optimizer.muon``;
* ``config_registry``: config functions (``--module titan_muon.torchtitan.v030 --config
  llama3_gqa_muon``) on the offline corpus;
* ``launch``: ``main(argv)``, which builds the ``Trainer.Config`` from a 0.2.2-style TOML file;
* ``cpu``, ``trainer``, ``data``, ``metrics``, ``models``: CPU shims, the trainer that applies
  them, the offline tokenizer, the optimizer metrics, small model flavors.

Nothing is imported here, so importing one module does not import torchtitan's trainer.
See docs/torchtitan.md, "torchtitan 0.3.0".
"""
