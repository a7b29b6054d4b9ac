"""Who owns each matrix and how its pieces travel: geometry, plans, transport, the engine, overlap."""
