"""How messages and bytes get in and out of a daemon (DESIGN §9, §12).

- :mod:`.control`: the control stream to the scheduler (gRPC ``Scheduler.Session``);
- :mod:`.localapi`: the local API's Unix socket for the training processes of this host;
- :mod:`.frames` and :mod:`.payloadio`: data-plane framing (header, payload, CRC-32), sending and
  receiving bytes (``sendfile``, ``recv_into``, the pipelined CRC);
- :mod:`.listener`: the data-plane listener peer daemons connect to;
- :mod:`.peers`: the connections to peer daemons and the one ``deliver`` (retry with backoff, the
  maybe-sent → UNKNOWN rule);
- :mod:`.sockets`, :mod:`.ratelimit`, :mod:`.budget`: addresses and socket options, token
  buckets (``--enforce-nic-rates``), the payload-memory budgets.

Channels carry messages; they know no role. The roles (:mod:`mlfabric.daemon.roles`) use them.
"""
