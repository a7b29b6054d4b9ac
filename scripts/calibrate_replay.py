"""The replay's Newton–Schulz cost model against NS measured on a GPU (scale_replay/calibrate.py):

    python scripts/calibrate_replay.py [--rows docs/gpu/h100_2026-11-27/crossover.json]
"""

from scale_replay.calibrate import main

if __name__ == "__main__":
    main()
