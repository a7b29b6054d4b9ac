"""matplotlib for the scripts that draw figures, which titan_muon itself never imports.

matplotlib comes with the ``plots`` extra. ``require_matplotlib()`` runs before the minutes of
training such a script does, so a missing install fails at once with the line that fixes it.
"""

from __future__ import annotations

import importlib.util
import sys

INSTALL = 'pip install -c constraints.txt -e ".[plots]"'


def require_matplotlib(script: str) -> None:
    """Exit with the install line when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        sys.exit(f"{script} draws its figure with matplotlib, which the plots extra installs: {INSTALL}")


def pyplot(script: str):
    """``matplotlib.pyplot`` on the Agg backend (files only, no display)."""
    require_matplotlib(script)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
