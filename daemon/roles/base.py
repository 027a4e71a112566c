"""What every role of a daemon shares: the verdict on an update (DESIGN §10)."""

from __future__ import annotations

from dataclasses import dataclass

from mlfabric.proto.v1 import control_pb2

__all__ = ["Verdict"]


@dataclass(frozen=True)
class Verdict:
    """The server's answer on one update (``UpdateVerdict`` / an ACK frame).

    ``handed_over`` is False for a DROPPED verdict on an update that never reached the
    server process (it was gone): certainly not applied, so it may go to a promoted replica.
    """

    outcome: int
    delay: int
    version: int
    reason: str
    handed_over: bool = True

    @classmethod
    def dropped(cls, reason: str, version: int = 0) -> Verdict:
        """A DROPPED verdict with ``reason``."""
        return cls(control_pb2.OUTCOME_DROPPED, 0, version, reason)

    @classmethod
    def unknown(cls, reason: str, version: int = 0) -> Verdict:
        """An UNKNOWN verdict: whether the update was applied cannot be known; ``reason`` says why."""
        return cls(control_pb2.OUTCOME_UNKNOWN, 0, version, reason)
