"""The roles a daemon plays for its host's processes and its peers (DESIGN §12).

One sub-package per role: :mod:`.worker` (intake of pushes and gets, the outgoing pushes and
their states, sending, the fallback), :mod:`.server` (hand-off to the server process, the one
verdict store, aggregates' members and synchronous rounds), :mod:`.aggregator` (the aggregator
hop, one- and multi-level), :mod:`.replica` (the replica role and the server's replication log)
and :mod:`.allreduce`. :mod:`.base` is what they share, :mod:`.directory` where the servers are.
Roles use channels (:mod:`mlfabric.daemon.channels`), never the host.
"""
