"""The scale replay's command (scale_replay/simulate.py says what it does):

    python scripts/simulate_scale.py               # the default cases; writes docs/scale.md
    python scripts/simulate_scale.py --quick       # Llama-3 8B at W = 8, nothing written
    python scripts/simulate_scale.py --large       # adds 70B at W = 256 and 405B at W = 128 (tens of minutes)
"""

from scale_replay.simulate import main

if __name__ == "__main__":
    main()
