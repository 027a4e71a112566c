"""Examples that use only the public mlfabric API."""
