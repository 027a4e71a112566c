"""Who is on the other end of the daemon's local socket: ``SO_PEERCRED`` and the allowed users.

The socket file's permissions are the first gate (the systemd unit opens its directory to one
group); :class:`LocalAccess` is the second, checked by the daemon on every accepted
connection: the peer process's uid and gid (from the kernel, not from anything the peer says)
must be the daemon's own uid, root, or belong to the allowed group (its primary gid is the
group's, or its user is listed as a member). A refused process is told why
(``LocalError`` ``permission_denied``) and disconnected (docs/security.md).
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import struct
from dataclasses import dataclass

__all__ = ["LocalAccess", "PeerCred", "peer_credentials"]

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class PeerCred:
    """A Unix-socket peer's process id, user id and group id (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCred:
    """The credentials of ``sock``'s peer, as the kernel recorded them at ``connect``.

    Examples
    --------
    >>> a, b = socket.socketpair()
    >>> peer_credentials(a).uid == os.getuid()
    True
    >>> a.close(); b.close()
    """
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return PeerCred(pid, uid, gid)


@dataclass(frozen=True)
class LocalAccess:
    """Which local processes may use the daemon.

    Parameters
    ----------
    uids : frozenset of int
        Users always allowed (the daemon's own uid and root).
    gid : int or None
        The allowed group (None: only ``uids``).
    members : frozenset of str
        User names listed as members of that group.
    group_name : str
        For messages.

    Examples
    --------
    >>> access = LocalAccess(frozenset({0, 1000}), None)
    >>> access.refusal(PeerCred(7, 1000, 1000)) is None
    True
    >>> print(access.refusal(PeerCred(7, 1001, 1001)))
    local API access denied: process 7 runs as uid 1001 gid 1001; allowed: uids 0, 1000 (no local_group set)
    """

    uids: frozenset[int]
    gid: int | None = None
    members: frozenset[str] = frozenset()
    group_name: str = ""

    @classmethod
    def for_group(cls, group: str | None) -> LocalAccess:
        """The daemon's own uid and root, plus ``group`` (a name or a numeric gid) if given.

        Raises
        ------
        ValueError
            No such group.
        """
        uids = frozenset({0, os.getuid()})
        if not group:
            return cls(uids)
        try:
            entry = grp.getgrgid(int(group)) if group.isdigit() else grp.getgrnam(group)
        except KeyError:
            raise ValueError(f"local_group: no group {group!r} on this host") from None
        return cls(uids, entry.gr_gid, frozenset(entry.gr_mem), entry.gr_name)

    def refusal(self, cred: PeerCred) -> str | None:
        """Why a peer with ``cred`` is refused, or None when it may connect."""
        if cred.uid in self.uids:
            return None
        if self.gid is not None:
            if cred.gid == self.gid:
                return None
            try:
                user = pwd.getpwuid(cred.uid).pw_name
            except KeyError:
                user = ""
            if user and user in self.members:
                return None
        allowed = f"uids {', '.join(str(u) for u in sorted(self.uids))}"
        allowed += (
            f", group {self.group_name} ({self.gid})" if self.gid is not None else " (no local_group set)"
        )
        who = f"process {cred.pid} runs as uid {cred.uid} gid {cred.gid}"
        return f"local API access denied: {who}; allowed: {allowed}"
