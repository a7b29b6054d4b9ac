"""titan_muon's TorchTitan adapters (the ``torchtitan`` extra): 0.2.x here, 0.3.x in
``titan_muon.torchtitan.v030``.

With torchtitan 0.2.x, importing this package (``[experimental] custom_import =
"titan_muon.torchtitan"``) registers the offline datasets and the ``titan_muon_llama3`` /
``titan_muon_mla`` train specs; ``titan_muon.torchtitan.config`` holds the ``[optimizer]``
fields and ``titan_muon.torchtitan.train`` is the launcher. torchtitan 0.3 has no train specs:
there this package registers nothing and ``titan_muon.torchtitan.v030`` holds the adapter.
See docs/torchtitan.md.

The core (``import titan_muon``) never imports this package: it needs torch alone.
"""

import re

from titan_muon.torchtitan.version import installed_torchtitan, uses_config_functions

INSTALL = 'pip install -c constraints.txt -e ".[torchtitan]" in a checkout (or pip install "titan_muon[torchtitan]" "torchtitan==0.2.2")'
# Top-level modules of the torchtitan extra that the adapter imports, directly or through
# torchtitan (tests/test_packaging.py checks this list against pyproject.toml).
EXTRA_MODULES = ("torchtitan", "datasets", "tokenizers", "tensorboard", "triton")
SUPPORTED = ((0, 2), (0, 3))


def check_torchtitan_version(version: str) -> None:
    """Refuse a torchtitan no adapter is built for, with the fix, before an obscure ImportError."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) not in SUPPORTED:
        raise ImportError(
            f"titan_muon.torchtitan has adapters for torchtitan 0.2.x (0.2.2 tested, TOML configs) and "
            f"0.3.x (0.3.0 tested, config functions), found torchtitan {version}. Install one with "
            'pip install "torchtitan==0.2.2" (or pip install -c constraints.txt ... in a checkout). '
            "The optimizer itself (import titan_muon) does not need torchtitan."
        )


if (_version := installed_torchtitan()) != "none":
    check_torchtitan_version(_version)

if not uses_config_functions():
    try:
        from titan_muon.torchtitan.data import register_datasets
        from titan_muon.torchtitan.v022.specs import register_train_specs
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] not in EXTRA_MODULES:
            raise
        raise ImportError(
            f"titan_muon.torchtitan needs {error.name}, which the torchtitan extra installs: {INSTALL}"
        ) from error

    register_datasets()
    register_train_specs()
