"""The server side of aggregation: member verdicts, de-duplication by member, synchronous rounds.

On the server's host every arriving update passes through :class:`ServerAggregation`
before the server process sees it (paper §5; DESIGN §3):

- **Members.** A frame carrying an aggregate lists its members (worker updates). The server
  process applies the sum once (``DeliverUpdate`` with ``num_updates = len(members)`` and the
  members); the ACK carries one :class:`MemberVerdict` per member: APPLIED with the member's
  own delay (model version at apply minus its base version) or DROPPED with the reason.
- **Exactly once.** Each member's verdict is remembered under its update id (with the
  server's de-duplication by update id), so a member re-sent directly after its aggregator
  died is answered from that memory and never applied twice; an aggregate holding a member
  that was already resolved here is refused (DROPPED, naming the member) — its sum cannot be
  applied without applying that member again. A frame whose members are being applied by
  another frame waits for that verdict. An aggregate id is answered from that memory only
  for the members it was applied with: the same id with other members (a scheduler that
  numbered its aggregates afresh) is refused, DROPPED naming the id, and its members are
  DROPPED — never reported APPLIED on the earlier aggregate's verdict.
- **Synchronous rounds** (``JobParams.sync_workers = N > 0``). Arriving payloads (plain
  updates and aggregates) are summed with the aggregation kernels until N worker updates are
  in; then the round goes to the server process as one ``DeliverUpdate`` (members = all of
  them) and the model version goes up by one. Every payload's ACK waits until the round is
  applied. A round whose workers do not all arrive (one vanished) is delivered with the
  members it has ``round_timeout`` seconds after its first arrival; its ``num_updates`` is then
  below N, which the server's ``on_update`` meta shows (``UpdateMeta.partial_round``).
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mlfabric.aggregators.codecs.payload import decode_to_raw, raw_layouts
from mlfabric.aggregators.kernels import Accumulator
from mlfabric.daemon.channels.frames import Frame, FrameHeader
from mlfabric.daemon.roles.base import Verdict
from mlfabric.daemon.roles.server.handoff import ServerHandoff
from mlfabric.proto.v1 import control_pb2, dataplane_pb2
from mlfabric.wire.tensors import layouts_from_pb, layouts_to_pb

__all__ = ["ServerAggregation", "SyncRounds", "member_verdicts", "members_of"]

_APPLIED = control_pb2.OUTCOME_APPLIED
_DROPPED = control_pb2.OUTCOME_DROPPED

#: ``hand_off(update_id, header, buffer) -> Verdict``: deliver to the server process, await it.
HandOff = Callable[[str, Any, Any], Verdict]


def members_of(h: Any) -> list[Any]:
    """The worker updates a frame carries: its ``members``, or the update itself.

    Examples
    --------
    >>> h = FrameHeader(update_id="w0/1", worker="w0", base_version=3, payload_bytes=8)
    >>> [(m.update_id, m.worker, m.base_version) for m in members_of(h)]
    [('w0/1', 'w0', 3)]
    """
    if h.members:
        return list(h.members)
    return [
        control_pb2.AggregateMember(
            update_id=h.update_id,
            worker=h.worker,
            base_version=h.base_version,
            norm=h.norm,
            src_host=h.src_host,
            bytes=h.payload_bytes,
        )
    ]


def member_verdicts(members: Iterable[Any], verdict: Verdict) -> list[Any]:
    """Each member's verdict from the verdict on the payload that summed them.

    APPLIED at version ``v`` (the version after the step): each member's delay is
    ``v - 1 - base_version``. DROPPED: the reason, and the delay it would have had now.

    Examples
    --------
    >>> ms = [control_pb2.AggregateMember(update_id="a/1", base_version=4),
    ...       control_pb2.AggregateMember(update_id="b/1", base_version=2)]
    >>> [(v.update_id, v.delay) for v in member_verdicts(ms, Verdict(_APPLIED, 3, 6, ""))]
    [('a/1', 1), ('b/1', 3)]
    """
    step = 1 if verdict.outcome == _APPLIED else 0
    return [
        control_pb2.MemberVerdict(
            update_id=m.update_id,
            outcome=verdict.outcome,
            delay=verdict.version - step - m.base_version,
            reason=verdict.reason,
        )
        for m in members
    ]


def _as_verdict(v: Any, version: int) -> Verdict:
    return Verdict(v.outcome, v.delay, version, v.reason)


@dataclass
class _Round:
    round_id: str
    deadline: float
    members: list[Any] = field(default_factory=list)
    frames: list[str] = field(default_factory=list)
    tensors: list[Any] = field(default_factory=list)
    payload_bytes: int = 0
    buffer: Any = None
    acc: Accumulator | None = None
    done: threading.Event = field(default_factory=threading.Event)
    verdict: Verdict | None = None


def _raw_member(frame: Frame) -> tuple[list[Any], int, Any]:
    """A round member's tensors, size and payload as they sum: a compressed one decoded.

    A round is summed in the tensors' own dtypes and delivered as such (docs/compression.md):
    encoded members are decoded into a raw payload first (``CodecError``, a ValueError
    naming the tensor, when one does not decode).
    """
    h = frame.header
    layouts = layouts_from_pb(h.tensors)
    if not any(x.encoding is not None for x in layouts):
        return list(h.tensors), int(h.payload_bytes), frame.payload
    raw, size = raw_layouts(layouts)
    decoded = bytearray(size)
    decode_to_raw(layouts, frame.payload, memoryview(decoded))
    return layouts_to_pb(raw), size, decoded


class SyncRounds:
    """The open round of one synchronous server: sums arrivals until ``workers`` updates are in.

    Parameters
    ----------
    job, server : str
        The server (names the rounds: ``"round:<job>:<server>:<n>"``).
    workers : int
        Worker updates per round (``JobParams.sync_workers``).
    timeout : float
        Seconds after a round's first arrival when it is delivered with the members it has.
    alloc : callable
        ``alloc(nbytes)`` -> a buffer with ``fd`` and ``release()`` (the round's sum).
    clock : callable
        Monotonic seconds.
    """

    def __init__(
        self,
        job: str,
        server: str,
        workers: int,
        timeout: float,
        alloc: Callable[[int], Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job, self.server, self.workers, self.timeout = job, server, workers, timeout
        self._alloc = alloc
        self._clock = clock
        self._lock = threading.Lock()
        self._current: _Round | None = None
        self._seq = itertools.count(1)

    def join(self, frame: Frame, members: list[Any], hand_off: HandOff) -> Verdict:
        """Sum ``frame`` into the open round; return the round's verdict once it is applied.

        Raises
        ------
        ValueError
            The frame's tensor layout differs from the round's first payload.
        """
        h = frame.header
        with self._lock:
            r = self._current
            if r is None:
                r = self._current = _Round(
                    f"round:{self.job}:{self.server}:{next(self._seq)}", self._clock() + self.timeout
                )
            if h.update_id not in r.frames:
                tensors, size, payload = _raw_member(frame)
                if r.acc is None:
                    r.buffer = self._alloc(size)
                    r.acc = Accumulator(layouts_from_pb(tensors), r.buffer)
                    r.tensors, r.payload_bytes = tensors, size
                elif tensors != r.tensors:
                    raise ValueError(
                        f"update {h.update_id}: tensor layout differs from the round's first update"
                    )
                r.acc.add(payload)
                r.frames.append(h.update_id)
                r.members.extend(members)
            mine = len(r.members) >= self.workers and self._current is r
            if mine:
                self._current = None
        if mine:
            self._deliver(r, hand_off)
        while not r.done.wait(max(0.01, min(0.1, r.deadline - self._clock()))):
            if self._clock() >= r.deadline:
                with self._lock:
                    mine = self._current is r
                    if mine:
                        self._current = None
                if mine:
                    self._deliver(r, hand_off)
        assert r.verdict is not None
        return r.verdict

    def _deliver(self, r: _Round, hand_off: HandOff) -> None:
        assert r.acc is not None
        try:
            r.acc.finish()
            header = FrameHeader(
                kind=dataplane_pb2.FRAME_KIND_UPDATE,
                update_id=r.round_id,
                job=self.job,
                server=self.server,
                worker=r.members[0].worker if len(r.members) == 1 else "",
                base_version=min(m.base_version for m in r.members),
                norm=sum(m.norm for m in r.members),
                num_updates=len(r.members),
                tensors=r.tensors,
                payload_bytes=r.payload_bytes,
                members=r.members,
            )
            r.verdict = hand_off(r.round_id, header, r.buffer)
        finally:
            if r.verdict is None:
                r.verdict = Verdict.dropped(f"round {r.round_id} could not be delivered")
            r.acc = None
            r.done.set()


class ServerAggregation:
    """Aggregates, member verdicts and synchronous rounds for the servers of one host (thread-safe).

    What is decided goes into each server's verdict store (``handoff.verdicts``,
    :class:`~mlfabric.daemon.roles.server.verdicts.VerdictStore`): the members' verdicts, and
    the claims that keep two frames from applying one member at once.

    Parameters
    ----------
    alloc : callable
        ``alloc(nbytes)`` -> a buffer with ``fd`` and ``release()`` for a round's sum.
    round_timeout : float
        Seconds a synchronous round waits for its missing workers.
    clock : callable
        Monotonic seconds.
    """

    def __init__(
        self,
        alloc: Callable[[int], Any],
        round_timeout: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.alloc = alloc
        self.round_timeout = round_timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._rounds: dict[tuple[str, str], SyncRounds] = {}

    def handle(
        self, frame: Frame, handoff: ServerHandoff, params: Any, hand_off: HandOff
    ) -> tuple[Verdict, list[Any]]:
        """The verdict on an arriving UPDATE and, for an aggregate, its members' verdicts.

        Parameters
        ----------
        frame : Frame
            The update (plain or aggregate), its layout already checked against the model.
        handoff : ServerHandoff
            The server role (its stored verdicts de-duplicate by update id).
        params : JobParams
            The job's params (``sync_workers``).
        hand_off : callable
            ``hand_off(update_id, header, buffer) -> Verdict`` delivers a payload to the server
            process and waits for its verdict.
        """
        return self._once(frame, handoff, functools.partial(self._apply, frame, handoff, params, hand_off))

    def _apply(
        self,
        frame: Frame,
        handoff: ServerHandoff,
        params: Any,
        hand_off: HandOff,
        members: list[Any],
        done: dict[str, Verdict],
    ) -> tuple[Verdict, list[Any]]:
        """:meth:`handle` with the members claimed (``done``: those resolved here already)."""
        h = frame.header
        if done:
            return self._already_resolved(h, members, done, handoff)
        if params is None or params.sync_workers <= 0:
            verdict = hand_off(h.update_id, h, frame.buffer)
            if not h.members:
                return verdict, []  # a plain update: the process's verdict, stored by the hand-off
        else:
            verdict = self._rounds_of(handoff, params).join(frame, members, hand_off)
        verdicts = member_verdicts(members, verdict)
        if h.members:
            for v in verdicts:
                handoff.verdicts.resolve(v.update_id, _as_verdict(v, verdict.version))
            oldest = max(v.delay for v in verdicts)
            verdict = Verdict(verdict.outcome, oldest, verdict.version, verdict.reason)
            handoff.verdicts.resolve(h.update_id, verdict)
            handoff.verdicts.keep_members(h.update_id, verdicts)
            return verdict, verdicts
        verdict = _as_verdict(verdicts[0], verdict.version)
        handoff.verdicts.resolve(h.update_id, verdict)
        return verdict, []

    def refuse(self, frame: Frame, handoff: ServerHandoff, reason: str) -> tuple[Verdict, list[Any]]:
        """DROPPED with ``reason`` without handing the payload over (e.g. it holds NaN or inf).

        Exactly once like :meth:`handle`: a re-sent copy gets the verdict the first got, members
        already resolved here keep theirs, every other member is DROPPED with ``reason`` and
        remembered, so a later copy of it is never applied either.
        """

        def refuse_now(members: list[Any], done: dict[str, Verdict]) -> tuple[Verdict, list[Any]]:
            h = frame.header
            if h.members:
                return self._refuse(h, members, done, handoff, reason, remember=True)
            verdict = done.get(h.update_id)
            if verdict is None:
                version = handoff.version
                verdict = Verdict(_DROPPED, version - h.base_version, version, reason)
                handoff.verdicts.resolve(h.update_id, verdict)
            return verdict, []

        return self._once(frame, handoff, refuse_now)

    def _once(
        self,
        frame: Frame,
        handoff: ServerHandoff,
        decide: Callable[[list[Any], dict[str, Verdict]], tuple[Verdict, list[Any]]],
    ) -> tuple[Verdict, list[Any]]:
        """Decide ``frame`` once: a re-sent copy gets its answer; else ``decide(members, done)``
        with its members claimed (``done``: their verdicts stored here already, if any)."""
        h = frame.header
        members = members_of(h)
        answered = self._answered(h, members, handoff)
        if answered is not None:
            return answered
        ids = [m.update_id for m in members]
        done = handoff.verdicts.claim(ids, h.update_id)
        try:
            return decide(members, done)
        finally:
            handoff.verdicts.release(ids, h.update_id)

    def _answered(
        self, h: Any, members: list[Any], handoff: ServerHandoff
    ) -> tuple[Verdict, list[Any]] | None:
        """The answer to a frame whose id is decided here already, else None.

        A re-sent copy gets the verdict (and member verdicts) the first got; the same id with
        other members is refused (:meth:`_reused`).
        """
        stored = handoff.verdicts.stored(h.update_id)
        if stored is None:
            return None
        known = handoff.verdicts.members(h.update_id)
        if not h.members or sorted(v.update_id for v in known) == sorted(m.update_id for m in members):
            return stored, known  # a re-sent copy: the verdict it got
        return self._reused(h, members, handoff)

    def _rounds_of(self, handoff: ServerHandoff, params: Any) -> SyncRounds:
        key = (handoff.job, handoff.name)
        with self._lock:
            rounds = self._rounds.get(key)
            if rounds is None or rounds.workers != params.sync_workers:
                rounds = SyncRounds(
                    handoff.job,
                    handoff.name,
                    params.sync_workers,
                    self.round_timeout,
                    self.alloc,
                    self._clock,
                )
                self._rounds[key] = rounds
            return rounds

    def _reused(self, h: Any, members: list[Any], handoff: ServerHandoff) -> tuple[Verdict, list[Any]]:
        """Refuse an aggregate whose id was already applied here with other members.

        Waits first for any frame still applying these members (a copy of this very
        aggregate between its verdict and its members' verdicts) and looks again.
        """
        ids = [m.update_id for m in members]
        owner = f"{h.update_id} (id already used)"  # not the first copy's owner: waits for it
        done = handoff.verdicts.claim(ids, owner)
        try:
            earlier = sorted(v.update_id for v in handoff.verdicts.members(h.update_id))
            stored = handoff.verdicts.stored(h.update_id)
            if earlier == sorted(ids) and stored is not None:
                return stored, handoff.verdicts.members(h.update_id)
            before = f"members {earlier}" if earlier else "members no longer remembered"
            reason = (
                f"aggregate id {h.update_id} was already used at this server with other {before}; "
                "refused, not applied (aggregate ids must not be reused, e.g. by a restarted scheduler)"
            )
            return self._refuse(h, members, done, handoff, reason, remember=False)
        finally:
            handoff.verdicts.release(ids, owner)

    def _already_resolved(
        self, h: Any, members: list[Any], done: dict[str, Verdict], handoff: ServerHandoff
    ) -> tuple[Verdict, list[Any]]:
        if not h.members:  # a plain update resolved here already (e.g. summed into an aggregate)
            return done[h.update_id], []
        reason = (
            f"aggregate {h.update_id} holds member(s) {sorted(done)} already resolved at the server; "
            "its sum cannot be applied without applying them again"
        )
        return self._refuse(h, members, done, handoff, reason, remember=True)

    def _refuse(
        self,
        h: Any,
        members: list[Any],
        done: dict[str, Verdict],
        handoff: ServerHandoff,
        reason: str,
        *,
        remember: bool,
    ) -> tuple[Verdict, list[Any]]:
        """DROPPED with ``reason``: members resolved already keep their verdicts, the others DROPPED.

        ``remember``: store the verdicts under the aggregate's id (else the id keeps the
        verdict of the aggregate it named first).
        """
        version = handoff.version
        verdicts = []
        for m in members:
            v = done.get(m.update_id)
            if v is not None:
                verdicts.append(
                    control_pb2.MemberVerdict(
                        update_id=m.update_id, outcome=v.outcome, delay=v.delay, reason=v.reason
                    )
                )
            else:  # resolved now, once: a later copy of it gets this verdict too
                dropped = control_pb2.MemberVerdict(
                    update_id=m.update_id, outcome=_DROPPED, delay=version - m.base_version, reason=reason
                )
                handoff.verdicts.resolve(m.update_id, _as_verdict(dropped, version))
                verdicts.append(dropped)
        verdict = Verdict.dropped(reason, version)
        if remember:
            handoff.verdicts.resolve(h.update_id, verdict)
            handoff.verdicts.keep_members(h.update_id, verdicts)
        return verdict, verdicts
