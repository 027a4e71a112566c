"""The aggregator hop: summing members into aggregates and forwarding them (one level or a tree)."""
