"""Replication: the replica role on its daemon, and the server's replication log on the server's daemon."""
