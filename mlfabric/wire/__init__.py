"""What the client and the daemon share on the host: one definition, imported by both sides.

- :mod:`mlfabric.wire.tensors`: the tensor layout and codec, the NaN/inf test, the model-spec
  check (``check_update``); training code sees it as :mod:`mlfabric.tensors`;
- :mod:`mlfabric.wire.framing`: the local API's length-prefixed messages with a memfd
  descriptor alongside, and where the daemon's socket is;
- :mod:`mlfabric.wire.memfd`: the memfd-backed buffers payloads travel in (one type, pooled
  or of its own);
- :mod:`mlfabric.wire.reports`: the lines of a transfer-report file;
- :mod:`mlfabric.wire.version`: the release (``Hello.version``);
- :mod:`mlfabric.wire.crc`: the CRC-32 of payloads (the C extension :mod:`mlfabric.wire._native`,
  which also has the receivers' fused CRC + NaN/inf test and the senders' copy with CRC);
- :mod:`mlfabric.wire.keepalive`: the control stream's gRPC keepalive.

Nothing here imports the client (:mod:`mlfabric.api`, :mod:`mlfabric.localclient`), the
daemon (:mod:`mlfabric.daemon`) or the scheduler; they import this package.
"""
