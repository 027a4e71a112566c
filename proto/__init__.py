"""Wire contracts of mlfabric (``package mlfabric.v1``).

The ``.proto`` sources ship in ``mlfabric/v1/`` beside this file; the generated stubs are
the subpackage :mod:`mlfabric.proto.v1` (regenerate with ``python scripts/gen_protos.py``).
"""
