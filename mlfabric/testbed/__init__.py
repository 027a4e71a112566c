"""Emulated cluster testbed on Linux network namespaces (DESIGN §6)."""
