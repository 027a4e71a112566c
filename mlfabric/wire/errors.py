"""The error type of mlfabric, shared by the client and the codec (:mod:`mlfabric.wire.tensors`).

``mlfabric.MlfabricError`` is this class (re-exported by :mod:`mlfabric.localclient`);
``except mlfabric.MlfabricError`` catches every error mlfabric reports to training code,
a tensor the codec cannot carry (:class:`~mlfabric.wire.tensors.TensorError`) included.
"""

from __future__ import annotations

__all__ = ["MlfabricError"]


class MlfabricError(RuntimeError):
    """An error reported by mlfabric: the daemon refused a request or cannot be reached.

    Attributes
    ----------
    code : str
        Machine-readable: ``unknown_job``, ``unknown_server``, ``duplicate_server``,
        ``params_mismatch`` (the scheduler's ``ErrorCode`` in lower case), ``bad_tensor``,
        ``bad_request``, ``unavailable``, ``no_daemon``, ``disconnected``, ...

    Examples
    --------
    >>> err = MlfabricError("no job 'j1' (known jobs: j0)", code="unknown_job")
    >>> err.code, str(err)
    ('unknown_job', "no job 'j1' (known jobs: j0)")
    """

    def __init__(self, message: str, code: str = "error") -> None:
        super().__init__(message)
        self.code = code
