"""DeMo (decoupled momentum across replicas): compressors and the step's replica agreement."""
