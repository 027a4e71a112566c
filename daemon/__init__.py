"""The per-host mlfabric daemon: local API, data plane and control stream."""
