"""titan_muon's TorchTitan 0.2.2 adapter (the ``torchtitan`` extra).

Importing this package (``[experimental] custom_import = "titan_muon.torchtitan"``)
registers the offline datasets and the ``titan_muon_llama3`` / ``titan_muon_mla`` train
specs; ``titan_muon.torchtitan.config`` holds the ``[optimizer]`` fields and
``titan_muon.torchtitan.train`` is the launcher. See docs/torchtitan.md.

The core (``import titan_muon``) never imports this package: it needs torch alone.
"""

import importlib.metadata
import re

INSTALL = 'pip install -c constraints.txt -e ".[torchtitan]" in a checkout (or pip install "titan_muon[torchtitan]" "torchtitan==0.2.2")'
# Top-level modules of the torchtitan extra that the adapter imports, directly or through
# torchtitan (tests/test_packaging.py checks this list against pyproject.toml).
EXTRA_MODULES = ("torchtitan", "datasets", "tokenizers", "tensorboard", "triton")


def check_torchtitan_version(version: str) -> None:
    """Refuse a torchtitan this adapter is not built for, with the fix, before an obscure ImportError.

    The adapter uses torchtitan 0.2's API (``JobConfig``, TOML configs, ``build_hf_tokenizer``);
    0.3 replaced it. pyproject admits 0.3.x for the port under way; until it lands, 0.3 is refused
    here (docs/torchtitan.md#compatibility).
    """
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) != (0, 2):
        raise ImportError(
            f"titan_muon.torchtitan is built for torchtitan 0.2.2, found torchtitan {version}; "
            'the port to 0.3 is not done yet. Install it with pip install "torchtitan==0.2.2" '
            "(or pip install -c constraints.txt ... in a checkout). "
            "The optimizer itself (import titan_muon) does not need torchtitan."
        )


def _installed_torchtitan_version() -> str | None:
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:  # missing (reported below) or a source tree on sys.path
        return None


if (_version := _installed_torchtitan_version()) is not None:
    check_torchtitan_version(_version)

try:
    from titan_muon.torchtitan.data import register_datasets
    from titan_muon.torchtitan.specs import register_train_specs
except ModuleNotFoundError as error:
    if (error.name or "").partition(".")[0] not in EXTRA_MODULES:
        raise
    raise ImportError(
        f"titan_muon.torchtitan needs {error.name}, which the torchtitan extra installs: {INSTALL}"
    ) from error

register_datasets()
register_train_specs()
