"""Which torchtitan is installed: 0.2.x (TOML job configs, train specs) or 0.3.x (config functions).

Read from the package metadata, so asking does not import torchtitan.
"""

from functools import cache
from importlib.metadata import PackageNotFoundError, version


def installed_torchtitan() -> str:
    """The installed torchtitan's version string, or "none"."""
    try:
        return version("torchtitan")
    except PackageNotFoundError:
        return "none"


@cache
def torchtitan_version() -> tuple[int, int]:
    """(major, minor) of the installed torchtitan; (0, 0) when it is not installed or has no
    release number (a source checkout reports "0.0.0+unknown")."""
    text = installed_torchtitan()
    if text == "none":
        return (0, 0)
    parts = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def uses_config_functions() -> bool:
    """True for torchtitan 0.3 and later: runs are ``--module M --config F``, extended through
    nested ``Config`` classes (titan_muon.torchtitan.v030); False for 0.2.x (TOML, train specs)."""
    return torchtitan_version() >= (0, 3)
