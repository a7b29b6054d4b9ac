"""Elements each rank sends per Muon step against its Muon shard (scale_replay/traffic.py):
the table of docs/exchange.md.

    python scripts/measure_traffic.py
"""

from scale_replay.traffic import main

if __name__ == "__main__":
    main()
