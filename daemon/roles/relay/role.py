"""Model relays: ``get`` with a version floor, the model cache, the scheduler's routes (DESIGN §12).

:class:`ModelRelays` answers every ``get`` of this host's workers and every GET frame of a
peer daemon (docs/model-relays.md):

- for a server of this host: from the model its process published (the server role,
  :meth:`~mlfabric.daemon.roles.server.serving.ServerRoles.answer_get`), after waiting up to
  the request's wait for a version at or above its ``min_version``;
- for a server elsewhere, with a floor (a local ``get(min_version=...)`` or any peer's GET):
  from the :class:`~mlfabric.daemon.roles.relay.cache.ModelCache` when it holds a version at or
  above the floor, without touching the network; else one fetch per (job, server) at a time
  (single-flight: the others wait for it) from this host's *upstream* — the relay host the
  scheduler named in a ``ModelRouteDirective``, or the server's daemon — and the answer is
  kept. A relay whose fetch fails (refused, reset, timed out, an ERROR) is passed over for the
  server's daemon for that fetch;
- for a server elsewhere without a floor: as before relays, from the server's daemon (its
  current model), kept in the cache too.

No answer is ever older than its floor, and the cache never goes back to an older version.
A route with ``chunk_bytes`` makes this host fetch the model in pieces
(:mod:`~mlfabric.daemon.roles.relay.pieces`), and a peer's piece GET is answered as soon as
the piece is here, while the rest arrives (chunk pipelining down a relay tree); without one,
store-and-forward: a relay answers once it has the whole model.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from mlfabric.daemon.channels.budget import ByteBudget
from mlfabric.daemon.channels.frames import Frame, FrameError, FrameHeader, error_header
from mlfabric.daemon.channels.listener import Response
from mlfabric.daemon.channels.localapi import LocalConnection
from mlfabric.daemon.channels.peers import PeerUnavailable
from mlfabric.daemon.channels.routing import FrameRoute
from mlfabric.daemon.roles.base import Role, RoleContext, Routes
from mlfabric.daemon.roles.directory import Directory
from mlfabric.daemon.roles.relay.cache import Flight, Key, ModelCache
from mlfabric.daemon.roles.relay.pieces import Growing, PieceError, fetch_pieces, piece_response
from mlfabric.daemon.roles.server.handoff import ModelSnapshot
from mlfabric.daemon.roles.server.serving import ServerRoles
from mlfabric.proto.v1 import dataplane_pb2
from mlfabric.wire.memfd import allocate
from mlfabric.wire.tensors import layouts_from_pb, layouts_to_pb

__all__ = ["DEFAULT_WAIT", "ModelRelays", "ModelUnavailable"]

_LOG = logging.getLogger("mlfabric.daemon")
_GET = dataplane_pb2.FRAME_KIND_GET
_MODEL = dataplane_pb2.FRAME_KIND_MODEL

#: seconds a ``get`` with a floor waits for a new enough model when it gives no wait of its own
DEFAULT_WAIT = 60.0


class ModelUnavailable(RuntimeError):
    """No model at or above the floor could be had; the message names the versions or the error."""


class ModelRelays(Role):
    """The model gets of this host: hosted servers, the cache, relays (thread-safe).

    Parameters
    ----------
    context : RoleContext
        Host name, task pool, clock.
    directory : Directory
        Where every job's servers are (the server's daemon, when there is no route).
    request : callable
        ``request(address, header, alloc=...) -> Reply``: one GET to a peer daemon
        (:meth:`~mlfabric.daemon.channels.peers.PeerPool.request`).
    serving : ServerRoles
        The servers of this host.
    budget : ByteBudget, optional
        Cached models are held against it.
    max_wait : float, optional
        The longest a GET waits for a new enough model (the peers' I/O timeout must outlast it).
    max_model_bytes : int, optional
        The largest model fetched in pieces (the daemon's payload limit, which a whole GET's
        frame check enforces).
    """

    def __init__(
        self,
        context: RoleContext,
        directory: Directory,
        request: Callable[..., Any],
        serving: ServerRoles,
        *,
        budget: ByteBudget | None = None,
        max_wait: float | None = None,
        max_model_bytes: int | None = None,
    ) -> None:
        self._ctx = context
        self._directory = directory
        self._request = request
        self._serving = serving
        self.cache = ModelCache(budget)
        self._max_wait = max_wait
        self._max_model_bytes = max_model_bytes
        self._lock = threading.Lock()
        #: (job, server) -> the scheduler's route (ModelRouteDirective)
        self._routes: dict[Key, Any] = {}
        self._counts: collections.Counter[str] = collections.Counter()

    def routes(self) -> Routes:
        return Routes(frames={FrameRoute.GET: self.on_get}, directives={"model_route": self.on_route})

    def stop(self) -> None:
        self.cache.close()

    def stats(self) -> dict[str, int]:
        """Counts: ``local_hits`` / ``peer_hits`` (answered from the cache), ``fetches`` (GETs
        sent upstream; in pieces: fetches), ``joined`` (gets that waited for another's fetch),
        ``relay_fallbacks``, ``server_gets`` (GETs answered for a server here), ``relayed``
        (GETs answered for a server elsewhere), ``server_pieces`` / ``peer_pieces`` (piece
        GETs answered for a server here / elsewhere), ``pieces_ahead`` (pieces answered while
        the rest of the model was still arriving), ``not_kept``; and the cache's ``entries``
        and ``bytes``."""
        with self._lock:
            counts = dict(self._counts)
        return counts | self.cache.stats() | {"not_kept": self.cache.not_kept}

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def on_route(self, route: Any) -> None:
        """A ``ModelRouteDirective``: fetch the model of (job, server) from its upstream from now on."""
        copy = type(route)()
        copy.CopyFrom(route)
        with self._lock:
            self._routes[(route.job, route.server)] = copy
        _LOG.info("model of server %r of job %r: upstream %s", route.server, route.job, route.upstream_host)

    def route(self, job: str, server: str) -> Any:
        """The route last received for (job, server), or None."""
        with self._lock:
            return self._routes.get((job, server))

    def _wait(self, seconds: float) -> float:
        wait = seconds if seconds > 0 else DEFAULT_WAIT
        return wait if self._max_wait is None else min(wait, self._max_wait)

    # ------------------------------------------------------------------ a local get

    def local_get(
        self, conn: LocalConnection, rid: int, job: str, server: str, min_version: int | None, wait: float
    ) -> None:
        """Answer a local ``get`` (on the task pool): a ``ModelReply`` + memfd, or ``LocalError``."""
        if self._serving.hosts(job, server):
            self._ctx.submit(self._local_hosted, conn, rid, job, server, min_version, self._wait(wait))
        else:
            self._ctx.submit(self._local_remote, conn, rid, (job, server), min_version, self._wait(wait))

    def _local_hosted(
        self, conn: LocalConnection, rid: int, job: str, server: str, min_version: int | None, wait: float
    ) -> None:
        if min_version is not None:
            handoff = self._serving.handoff(job, server)
            snap = handoff.wait_published(min_version, wait) if handoff is not None else None
            if snap is None or snap.version < min_version:
                have = None if snap is None else snap.version
                conn.error(rid, "unavailable", _too_old(job, server, have, min_version, wait))
                return
        self._serving.send_model(conn, rid, job, server)

    def _local_remote(
        self, conn: LocalConnection, rid: int, key: Key, min_version: int | None, wait: float
    ) -> None:
        deadline = self._ctx.clock() + wait
        try:
            if min_version is None:  # the server's current model, as without relays (kept too)
                leftover, floor = self._fetch_from_server(key, 0, deadline), 0
            else:
                leftover, floor = self.obtain(key, min_version, deadline, "local"), min_version
        except ModelUnavailable as exc:
            conn.error(rid, "unavailable", str(exc))
            return

        def send(snap: ModelSnapshot) -> None:
            _LOG.debug(
                "get of %s at or above %s: version %d in %.3f s",
                key,
                min_version,
                snap.version,
                self._ctx.clock() - deadline + wait,
            )
            conn.send(snap.local_event(rid), snap.fd)

        if leftover is not None:
            send(leftover)
            leftover.close()
        elif self.cache.with_entry(key, floor, send) is None:  # cannot happen: kept ones stay
            conn.error(rid, "unavailable", f"model of server {key[1]!r} of job {key[0]!r} was not kept")

    # ------------------------------------------------------------------ a peer's GET

    def on_get(self, frame: Frame) -> Response:
        """A GET frame: for a server here, from its published model; else from the cache or upstream."""
        h = frame.header
        frame.release()
        _LOG.debug("GET from %s of %s/%s at or above %d", h.src_host, h.job, h.server, h.min_version)
        where = f"server {h.server!r} of job {h.job!r}"
        if h.min_version < 0:
            why = f"min_version {h.min_version} is negative (a version is 0 or more)"
            return self._error(f"GET of {where}: {why}")
        if h.range_bytes > 0 and h.replica:
            return self._error(f"GET of {where}: a replica attaches with a whole GET, not a piece")
        wait = self._wait(h.wait_seconds)
        handoff = self._serving.handoff(h.job, h.server)
        if handoff is not None and h.range_bytes > 0:  # a piece of a model published here
            snap = handoff.wait_published(h.min_version, wait)
            if snap is None or snap.version < h.min_version:
                have = None if snap is None else snap.version
                return self._error(_too_old(h.job, h.server, have, h.min_version, wait))
            self._count("server_pieces")
            return piece_response(
                h, snap.version, snap.layouts, snap.payload_bytes, snap.mapping, self._ctx.host
            )
        if handoff is not None or h.replica:  # served here (or a replica attaching: its error)
            if handoff is not None and h.min_version > 0:
                snap = handoff.wait_published(h.min_version, wait)
                if snap is None or snap.version < h.min_version:
                    have = None if snap is None else snap.version
                    return self._error(_too_old(h.job, h.server, have, h.min_version, wait))
            self._count("server_gets")
            return self._serving.answer_get(h)
        key = (h.job, h.server)
        if self._server_address(key) is None:
            known = self._directory.servers(h.job)
            return self._error(f"unknown {where} on host {self._ctx.host!r} (servers known here: {known})")
        if h.range_bytes > 0:
            return self._answer_piece(h, key, self._ctx.clock() + wait)
        try:
            leftover = self.obtain(key, h.min_version, self._ctx.clock() + wait, "peer", asked_by=h.src_host)
        except ModelUnavailable as exc:
            return self._error(str(exc))
        self._count("relayed")
        if leftover is not None:
            response = self._response(h, leftover)
            leftover.close()  # the mapping backs the response
            return response
        cached = self.cache.with_entry(key, h.min_version, lambda snap: self._response(h, snap))
        return cached or self._error(f"model of {where} was not kept on host {self._ctx.host!r}")

    def _answer_piece(self, h: Any, key: Key, deadline: float) -> Response:
        """A peer's piece GET: from the cache, or from the model arriving here once it holds the piece."""
        floor, end = h.min_version, h.range_offset + h.range_bytes
        while True:
            cached = self.cache.with_entry(
                key,
                floor,
                lambda s: piece_response(h, s.version, s.layouts, s.payload_bytes, s.mapping, self._ctx.host),
            )
            if cached is not None:
                self._count("peer_pieces")
                return cached
            leader, flight = self.cache.begin(key, floor)
            if flight is None:
                continue  # cached by now
            if leader:  # the fetch runs on the pool; this GET waits for its piece
                self._ctx.submit(self._lead, key, floor, deadline, h.src_host, flight)
            g = flight.wait_piece(floor, end, deadline - self._ctx.clock())
            if g is not None:
                self._count("peer_pieces")
                if not g.complete:
                    self._count("pieces_ahead")  # forwarded while the rest still arrives
                return piece_response(h, g.version, g.layouts, g.model_bytes, g.mapping, self._ctx.host)
            if not flight.done.is_set():
                have = self.cache.version(key)
                waited = f"waiting for the piece at {h.range_offset} on host {self._ctx.host!r}"
                return self._error(_too_old(key[0], key[1], have, floor, None, waited))
            if flight.error is not None and flight.min_version <= floor:
                return self._error(flight.error)
            # it ended (ok: the cache may be new enough now; failed for a lower floor): again

    def _lead(self, key: Key, floor: int, deadline: float, asked_by: str, flight: Flight) -> None:
        """Lead a fetch a peer's piece GET started (on the task pool)."""
        try:
            leftover = self._lead_flight(key, floor, deadline, asked_by, flight)
        except ModelUnavailable:
            return  # the flight ended with the error: its waiters have it
        if leftover is not None:  # not kept (the budget): its pieces were answered from the flight
            leftover.close()

    def _lead_flight(
        self, key: Key, floor: int, deadline: float, asked_by: str, flight: Flight
    ) -> ModelSnapshot | None:
        """Fetch for ``flight`` and end it (its waiters wake); a failure ends it with its error and raises."""
        try:
            leftover = self._fetch(key, floor, deadline, asked_by, flight)
        except ModelUnavailable as exc:
            self.cache.end(key, flight, str(exc))
            raise
        self.cache.end(key, flight)
        return leftover

    def _response(self, h: Any, snap: ModelSnapshot) -> Response:
        _LOG.debug("GET from %s at or above %d: version %d", h.src_host, h.min_version, snap.version)
        header = FrameHeader(
            kind=_MODEL,
            job=h.job,
            server=h.server,
            version=snap.version,
            tensors=layouts_to_pb(snap.layouts),
            src_host=self._ctx.host,
        )
        return Response(header, snap.mapping, crc32=snap.checksum())

    def _error(self, reason: str) -> Response:
        return Response(error_header(reason, src_host=self._ctx.host))

    # ------------------------------------------------------------------ the cache and the fetches

    def obtain(
        self, key: Key, min_version: int, deadline: float, who: str, *, asked_by: str = ""
    ) -> ModelSnapshot | None:
        """Make sure a model at or above ``min_version`` is cached, fetching it once if need be.

        Returns None (answer from the cache), or the fetched model when the budget had no room
        to keep it (the caller answers from it and closes it). ``who``: ``"local"`` or
        ``"peer"`` (counted); ``asked_by``: the host of the peer asking (never fetched from).

        Raises
        ------
        ModelUnavailable
            Nothing new enough came by ``deadline``, or the fetch failed.
        """
        while True:
            leader, flight = self.cache.begin(key, min_version)
            if flight is None:  # cached by now, at or above the floor
                self._count(f"{who}_hits")
                return None
            if leader:
                return self._lead_flight(key, min_version, deadline, asked_by, flight)
            self._count("joined")
            _LOG.debug(
                "get of %s at or above %d (%s) joins the fetch at or above %d",
                key,
                min_version,
                who,
                flight.min_version,
            )
            if not flight.done.wait(max(0.0, deadline - self._ctx.clock())):
                have = self.cache.version(key)
                waited = f"waiting for the fetch under way on host {self._ctx.host!r}"
                raise ModelUnavailable(_too_old(key[0], key[1], have, min_version, None, waited))
            if flight.error is not None and flight.min_version <= min_version:
                raise ModelUnavailable(flight.error)
            # it ended (ok: the cache may be new enough now; failed for a higher floor): again

    def _server_address(self, key: Key) -> tuple[str, str] | None:
        """(host, data address) of the server's daemon: the directory's, else the route's."""
        loc = self._directory.lookup(*key)
        if loc is not None:
            return loc.host, loc.data_address
        route = self.route(*key)
        if route is not None and route.server_address:
            return route.server_host, route.server_address
        return None

    def _fetch(
        self, key: Key, min_version: int, deadline: float, asked_by: str, flight: Flight
    ) -> ModelSnapshot | None:
        route = self.route(*key)
        server = self._server_address(key)
        relay = (
            route is not None
            and route.upstream_address
            and route.upstream_host not in (route.server_host, self._ctx.host, asked_by)
            and (server is None or route.upstream_address != server[1])
        )
        if route is not None and route.chunk_bytes > 0:
            upstream = (route.upstream_host, route.upstream_address) if relay else None
            return self._fetch_in_pieces(key, min_version, deadline, flight, route.chunk_bytes, upstream)
        if relay:
            try:
                upstream = (route.upstream_host, route.upstream_address)
                return self._fetch_from(*upstream, key, min_version, deadline)
            except ModelUnavailable as exc:
                self._count("relay_fallbacks")
                _LOG.warning("%s; fetching from the server's daemon instead", exc)
        return self._fetch_from_server(key, min_version, deadline)

    def _fetch_in_pieces(
        self,
        key: Key,
        floor: int,
        deadline: float,
        flight: Flight,
        chunk_bytes: int,
        upstream: tuple[str, str] | None,
    ) -> ModelSnapshot | None:
        """Fetch in pieces from ``upstream`` (a relay), else or then from the server's daemon; keep it.

        A relay that fails midway is passed over for the server's daemon, which continues the
        same version from the byte reached; if the server has moved on from that version, a
        fresh fetch of its newest (never older than ``floor``) replaces it, and the peers waiting
        for pieces of the old one are answered ERROR (they fall back to the server).
        """

        def left() -> float:
            return deadline - self._ctx.clock()

        def start(version: int, layouts: Any, model_bytes: int) -> Growing:
            g = Growing(version, layouts, model_bytes, flight.cond)
            with flight.cond:
                old, flight.growing = flight.growing, g
                flight.cond.notify_all()
            if old is not None:
                old.release()
            return g

        def fetch(host: str, address: str, resume: Growing | None) -> Growing:
            self._count("fetches")
            return fetch_pieces(
                self._request,
                host,
                address,
                key,
                floor,
                chunk_bytes,
                left,
                self._ctx.host,
                start,
                resume,
                max_bytes=self._max_model_bytes,
            )

        growing: Growing | None = None
        if upstream is not None:
            try:
                growing = fetch(*upstream, None)
            except PieceError as exc:
                self._count("relay_fallbacks")
                _LOG.warning("%s; fetching the rest from the server's daemon instead", exc)
                growing = flight.growing
        if growing is None or not growing.complete:
            server = self._server_or_raise(key)
            try:
                growing = fetch(*server, growing)
            except PieceError as exc:
                if growing is None or flight.growing is not growing:
                    flight.release_growing()
                    raise ModelUnavailable(str(exc)) from None
                _LOG.info("%s; fetching the newest model afresh", exc)
                try:
                    growing = fetch(*server, None)
                except PieceError as again:
                    flight.release_growing()
                    raise ModelUnavailable(str(again)) from None
        return self.cache.keep(
            key, growing.version, growing.layouts, growing.model_bytes, growing.take_buffer()
        )

    def _server_or_raise(self, key: Key) -> tuple[str, str]:
        """(host, data address) of the server's daemon; :class:`ModelUnavailable` naming the known."""
        server = self._server_address(key)
        if server is None:
            known = self._directory.servers(key[0])
            raise ModelUnavailable(f"unknown server {key[1]!r} in job {key[0]!r} (servers: {known})")
        return server

    def _fetch_from_server(self, key: Key, min_version: int, deadline: float) -> ModelSnapshot | None:
        return self._fetch_from(*self._server_or_raise(key), key, min_version, deadline)

    def _fetch_from(
        self, host: str, address: str, key: Key, min_version: int, deadline: float
    ) -> ModelSnapshot | None:
        """One GET to the daemon of ``host``; the model is kept (see :meth:`ModelCache.keep`)."""
        job, server = key
        where = f"get of server {server!r} of job {job!r} from host {host!r} ({address})"
        header = FrameHeader(
            kind=_GET,
            job=job,
            server=server,
            src_host=self._ctx.host,
            min_version=min_version,
            wait_seconds=max(0.0, deadline - self._ctx.clock()),
        )
        self._count("fetches")
        try:
            reply = self._request(address, header, alloc=allocate)
        except (PeerUnavailable, FrameError, OSError) as exc:  # refused, reset, timed out, garbled
            raise ModelUnavailable(f"{where}: {exc}") from None
        buffer = reply.memfd()
        h = reply.header
        if h.kind != _MODEL or h.version < min_version:
            buffer.release()
            reason = h.reason if h.kind != _MODEL else f"answered version {h.version}, below {min_version}"
            raise ModelUnavailable(f"{where}: {reason}")
        return self.cache.keep(key, h.version, layouts_from_pb(h.tensors), h.payload_bytes, buffer)


def _too_old(job: str, server: str, have: int | None, want: int, wait: float | None, how: str = "") -> str:
    """The error of a ``get`` whose floor was not reached: names both versions."""
    newest = "no model" if have is None else f"version {have}"
    within = f" within {wait:g} s" if wait is not None else f" ({how})"
    return f"server {server!r} of job {job!r}: min_version {want} not reached{within}; newest here: {newest}"
