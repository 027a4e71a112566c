"""The mlfabric scheduler: bandwidth graph, policies and the scheduler service.

Pure, deterministic algorithm modules (graph, timelines, STF ordering, aggregation,
replication, bandwidth estimation, the invariant checker) live beside the service
(:mod:`mlfabric.scheduler.service.core`), which only does I/O and calls them.
"""
