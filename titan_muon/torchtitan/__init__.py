"""titan_muon's TorchTitan adapters: 0.2.2 here, 0.3.0 in ``titan_muon.torchtitan.v030``.

With torchtitan 0.2.x, importing this package (``[experimental] custom_import =
"titan_muon.torchtitan"``) registers the offline datasets and the ``titan_muon_llama3`` /
``titan_muon_mla`` train specs; ``titan_muon.torchtitan.config`` holds the ``[optimizer]``
fields. torchtitan 0.3 has no train specs: there this package registers nothing, and
``titan_muon.torchtitan.v030`` holds the adapter. See docs/torchtitan.md.
"""

from titan_muon.torchtitan.version import uses_config_functions

if not uses_config_functions():
    from titan_muon.torchtitan.data import register_datasets
    from titan_muon.torchtitan.specs import register_train_specs

    register_datasets()
    register_train_specs()
