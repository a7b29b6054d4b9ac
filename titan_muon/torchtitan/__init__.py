"""titan_muon's TorchTitan 0.2.2 adapter.

Importing this package (``[experimental] custom_import = "titan_muon.torchtitan"``)
registers the offline datasets and the ``titan_muon_llama3`` / ``titan_muon_mla`` train
specs; ``titan_muon.torchtitan.config`` holds the ``[optimizer]`` fields. See
docs/torchtitan.md.
"""

from titan_muon.torchtitan.data import register_datasets
from titan_muon.torchtitan.specs import register_train_specs

register_datasets()
register_train_specs()
