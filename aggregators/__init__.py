"""Aggregator hops: summing several updates into one aggregate before the server (paper §5).

:mod:`mlfabric.aggregators.kernels` holds the summing kernels (in place, vectorised, float16
and bfloat16 accumulated in float32). The daemons run them: an aggregator hop's daemon
(:mod:`mlfabric.daemon.roles.aggregator.role`) and, for synchronous rounds, the server's daemon
(:mod:`mlfabric.daemon.roles.server.rounds`). The plans are made by
:mod:`mlfabric.scheduler.policies.aggregation`.

:mod:`mlfabric.aggregators.codecs` holds the codecs whose payloads an aggregator can still sum
(fp16, bf16, int8, top-k, random-k, error feedback; ``docs/compression.md``); fp16, bf16 and
int8 travel on the wire (:mod:`~mlfabric.aggregators.codecs.payload`) and aggregator hops sum
encoded members (:mod:`~mlfabric.aggregators.codecs.payloadsum`).
"""
