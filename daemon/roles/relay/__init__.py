"""Model relays: the daemon's model cache and ``get`` with a version floor (docs/model-relays.md)."""
