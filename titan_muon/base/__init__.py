"""The ground floor: how a DTensor is laid out over ranks and which block this rank holds.
Imports nothing else of titan_muon; every other layer may import it."""
