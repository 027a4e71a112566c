"""Aggregator hops: summing several updates into one aggregate before the server.

Executing aggregation in daemons comes with a later issue; the plans are made by
:mod:`mlfabric.scheduler.policies.aggregation`.
"""
