"""A model in pieces: chunk pipelining through relays (docs/model-relays.md, issue 23).

Store-and-forward, a relay answers once it holds the whole model, so a chain of relays costs
one whole transfer per hop, and one relay serving a rack sends a copy per host through its
own NIC. In pieces, a daemon fetches the model as ``GET``\\ s of ``chunk_bytes`` each (the
scheduler's ``ModelRouteDirective.chunk_bytes``), and answers a peer's piece as soon as it
holds it: a relay tree (the broadcast planner's, docs/broadcast.md) moves the model to its
last host in about one transfer across the bottleneck plus one piece per hop.

- :class:`Growing`: the model of one fetch while its pieces arrive: a memfd written in order,
  readable (a read-only mapping) up to :attr:`Growing.have`;
- :func:`piece_response`: the MODEL answer to a piece GET from a model held whole or growing;
- :func:`fetch_pieces`: the fetching side, one GET per piece from one upstream, resumable
  from another (the server's daemon when a relay fails midway, for the same version).

Every piece after the first names the version the first one got (``exact_version``): no
model is ever spliced from two versions, and a host never gets one older than its floor.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from typing import Any

from mlfabric.daemon.channels.frames import FrameError, FrameHeader, error_header
from mlfabric.daemon.channels.listener import Response
from mlfabric.daemon.channels.peers import PeerUnavailable
from mlfabric.proto.v1 import dataplane_pb2
from mlfabric.wire.memfd import PooledBuffer, allocate
from mlfabric.wire.tensors import Layout, layouts_from_pb, layouts_to_pb

__all__ = ["Growing", "PieceError", "fetch_pieces", "piece_response"]

_GET = dataplane_pb2.FRAME_KIND_GET
_MODEL = dataplane_pb2.FRAME_KIND_MODEL


class PieceError(RuntimeError):
    """A piece could not be had from one upstream (the message says why)."""


class Growing:
    """A model arriving in pieces, in order; what is in is readable while the rest arrives.

    Parameters
    ----------
    version : int
        The model's version (every piece is of it).
    layouts : list of Layout
        Its tensors.
    model_bytes : int
        Its whole size.
    cond : threading.Condition
        Notified as pieces arrive (the flight's, so waiters for the flight wake too).

    Examples
    --------
    >>> g = Growing(3, [], 6, threading.Condition())
    >>> g.write(0, b"abc"); g.have, bytes(g.mapping[:3]), g.complete
    (3, b'abc', False)
    >>> g.write(3, b"def"); g.complete, bytes(g.mapping[:])
    (True, b'abcdef')
    >>> g.write(1, b"x")
    Traceback (most recent call last):
    ...
    ValueError: piece at 1 does not continue the model (6 of 6 bytes in)
    """

    def __init__(
        self, version: int, layouts: list[Layout], model_bytes: int, cond: threading.Condition
    ) -> None:
        self.version = version
        self.layouts = layouts
        self.model_bytes = model_bytes
        self.buffer: PooledBuffer | None = allocate(model_bytes)
        self.mapping = mmap.mmap(self.buffer.fd, model_bytes, prot=mmap.PROT_READ) if model_bytes else None
        self.have = 0
        self._cond = cond

    @property
    def complete(self) -> bool:
        """Whether every byte is in."""
        return self.have >= self.model_bytes

    def write(self, offset: int, data: Any) -> None:
        """The piece at ``offset`` (the next one) is in; waiters wake."""
        n = len(data)
        if offset != self.have or offset + n > self.model_bytes or self.buffer is None:
            raise ValueError(
                f"piece at {offset} does not continue the model ({self.have} of {self.model_bytes} bytes in)"
            )
        self.buffer[offset : offset + n] = data
        with self._cond:
            self.have += n
            self._cond.notify_all()

    def take_buffer(self) -> PooledBuffer:
        """The memfd, whole, for the cache to keep (the mapping stays readable)."""
        if self.buffer is None or not self.complete:
            raise ValueError("the model is not complete")
        buffer, self.buffer = self.buffer, None
        return buffer

    def release(self) -> None:
        """Drop the memfd if nobody took it (a fetch that failed); the mapping lives on with its readers."""
        buffer, self.buffer = self.buffer, None
        if buffer is not None:
            buffer.release()


def piece_response(
    h: Any, version: int, layouts: list[Layout], model_bytes: int, mapping: Any, src_host: str
) -> Response:
    """The MODEL answer to the piece GET ``h`` from a model (whole or growing) that holds it.

    An ``exact_version`` piece of another version, or an offset past the model's end, is an
    ERROR naming both.

    Examples
    --------
    >>> h = FrameHeader(kind=_GET, job="j", server="ps", range_offset=2, range_bytes=3, min_version=1)
    >>> r = piece_response(h, 1, [], 4, b"abcd", "r")
    >>> bytes(r.payload), r.header.range_offset, r.header.model_bytes, r.header.version
    (b'cd', 2, 4, 1)
    >>> h.exact_version = True
    >>> piece_response(h, 2, [], 4, b"abcd", "r").header.reason
    "piece of version 1 of server 'ps' of job 'j': version 2 here now"
    """
    where = f"server {h.server!r} of job {h.job!r}"
    if h.exact_version and version != h.min_version:
        return Response(
            error_header(
                f"piece of version {h.min_version} of {where}: version {version} here now", src_host=src_host
            )
        )
    start = int(h.range_offset)
    if start > model_bytes:
        why = f"range_offset {start} is past the end of version {version} of {where} ({model_bytes} bytes)"
        return Response(error_header(why, src_host=src_host))
    end = min(model_bytes, start + int(h.range_bytes))
    header = FrameHeader(
        kind=_MODEL,
        job=h.job,
        server=h.server,
        version=version,
        tensors=layouts_to_pb(layouts) if start == 0 else [],
        src_host=src_host,
        range_offset=start,
        model_bytes=model_bytes,
    )
    payload = memoryview(mapping)[start:end] if mapping is not None and end > start else b""
    return Response(header, payload)


def fetch_pieces(
    request: Callable[..., Any],
    host: str,
    address: str,
    key: tuple[str, str],
    min_version: int,
    chunk_bytes: int,
    deadline: Callable[[], float],
    src_host: str,
    start: Callable[[int, list[Layout], int], Growing],
    growing: Growing | None = None,
    max_bytes: int | None = None,
) -> Growing:
    """Fetch a model in pieces of ``chunk_bytes`` from the daemon at ``address``.

    Parameters
    ----------
    request : callable
        ``request(address, header) -> Reply`` (one GET, one attempt).
    host, address : str
        The upstream daemon.
    key : (job, server)
        The model.
    min_version : int
        The floor (the first piece's; the next ones ask for the version it got).
    chunk_bytes : int
        Bytes per piece (> 0).
    deadline : callable
        Seconds left for the fetch (each GET waits at most that long upstream).
    src_host : str
        This host (named in the GETs).
    start : callable
        ``start(version, layouts, model_bytes) -> Growing``: called on the first piece.
    growing : Growing, optional
        A fetch to continue (from its :attr:`~Growing.have` on, same version).
    max_bytes : int, optional
        The largest model taken (the daemon's payload limit): a bigger one is refused before
        anything is allocated for it.

    Returns
    -------
    Growing
        Complete.

    Raises
    ------
    PieceError
        The upstream failed, answered ERROR, another version or a piece that does not fit;
        ``growing`` (or the one started) keeps what came in.
    """
    job, server = key
    where = f"piece of server {server!r} of job {job!r} from host {host!r} ({address})"
    while growing is None or not growing.complete:
        offset = 0 if growing is None else growing.have
        left = deadline()
        if left <= 0:
            raise PieceError(f"{where}: no time left (at byte {offset})")
        header = FrameHeader(
            kind=_GET,
            job=job,
            server=server,
            src_host=src_host,
            min_version=min_version if growing is None else growing.version,
            exact_version=growing is not None,
            wait_seconds=left,
            range_offset=offset,
            range_bytes=chunk_bytes,
        )
        try:
            reply = request(address, header)
        except (PeerUnavailable, FrameError, OSError) as exc:  # refused, reset, timed out, garbled
            raise PieceError(f"{where}: {exc}") from None
        try:
            h = reply.header
            if h.kind != _MODEL:
                raise PieceError(f"{where}: {h.reason}")
            n = len(reply.payload)
            total = int(h.model_bytes)
            want = min(chunk_bytes, total - offset)
            if max_bytes is not None and total > max_bytes:
                raise PieceError(f"{where}: a model of {total} bytes exceeds the limit of {max_bytes}")
            if growing is None:
                if h.version < min_version or h.range_offset != 0 or n != want:
                    raise PieceError(
                        f"{where}: answered version {h.version} bytes {h.range_offset}+{n} of {total}"
                    )
                growing = start(int(h.version), layouts_from_pb(h.tensors), total)
            elif (
                h.version != growing.version
                or h.range_offset != offset
                or total != growing.model_bytes
                or n != want
            ):
                raise PieceError(
                    f"{where}: asked version {growing.version} at {offset}, answered version {h.version} "
                    f"bytes {h.range_offset}+{n} of {total}"
                )
            growing.write(offset, reply.payload)
        finally:
            reply.release()
    return growing
