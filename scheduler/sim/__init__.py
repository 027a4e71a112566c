"""Fluid discrete-event simulator of mlfabric policies (DESIGN §6, issue 3 item 9)."""
