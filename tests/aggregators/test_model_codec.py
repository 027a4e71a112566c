"""A server's model compressed on the wire (``Params(model_compression=)``, docs/compression.md).

The encode of a model snapshot (what :meth:`mlfabric.Server.publish` hands its daemon), the
decode a worker's ``get`` makes of it (:func:`mlfabric.tensorio.from_fd`), the frame check of
encoded MODEL frames (whole and in pieces), and the stats of the model bytes served.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import numpy as np
import pytest

from mlfabric.aggregators.codecs import Bf16Codec, CodecError, Fp16Codec
from mlfabric.aggregators.codecs.snapshot import encode_model, parse_model_codec
from mlfabric.daemon.channels.frames import (
    MAGIC,
    FrameError,
    FrameHeader,
    FrameLimits,
    check_header,
    recv_frame,
    send_frame,
)
from mlfabric.daemon.stats import Counters
from mlfabric.params import Params
from mlfabric.proto.v1 import dataplane_pb2
from mlfabric.tensorio import from_fd, to_memfd
from mlfabric.tensors import (
    Encoding,
    Layout,
    decode,
    encode_into,
    layouts_from_pb,
    layouts_to_pb,
    plan_layout,
)

_MODEL = dataplane_pb2.FRAME_KIND_MODEL
_ACK = dataplane_pb2.FRAME_KIND_ACK


def _model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((64, 33)).astype(np.float32),
        "b": rng.standard_normal(17),  # float64
        "h": rng.standard_normal(5).astype(np.float16),  # travels as it is
    }


def _published(model: dict[str, np.ndarray], spec: str | None) -> tuple[list[Layout], int, dict]:
    """What a server publishes and a worker's get returns: (layouts, payload bytes, tensors)."""
    codec = parse_model_codec(spec)
    words, encoded = (model, None) if codec is None else encode_model(model, codec)
    fd, layouts, total = to_memfd(words, encoded=encoded)
    return layouts, total, from_fd(layouts_to_pb(layouts), fd)  # from_fd closes fd


@pytest.mark.parametrize("spec,codec", [("fp16", Fp16Codec()), ("bf16", Bf16Codec())])
def test_a_snapshot_decodes_to_the_codecs_rounding_in_its_own_dtypes(spec: str, codec: object) -> None:
    model = _model()
    before = {k: v.copy() for k, v in model.items()}
    layouts, total, got = _published(model, spec)
    _, raw_total, raw = _published(model, None)
    assert {x.name: x.encoding.codec if x.encoding else None for x in layouts} == {
        "w": spec,
        "b": spec,
        "h": None,
    }
    assert total == 64 * 33 * 2 + 17 * 2 + 5 * 2 and raw_total == 64 * 33 * 4 + 17 * 8 + 5 * 2
    for name in ("w", "b"):
        assert got[name].dtype == model[name].dtype and got[name].shape == model[name].shape
        expected = codec.decode(codec.encode(model[name]))  # type: ignore[attr-defined]
        np.testing.assert_array_equal(got[name], expected)
        assert not np.array_equal(got[name], model[name])  # rounded, really
        np.testing.assert_array_equal(raw[name], model[name])  # uncompressed: unchanged
    np.testing.assert_array_equal(got["h"], model["h"])
    for name, value in model.items():  # the server's own model stays exact
        np.testing.assert_array_equal(value, before[name])


def test_a_tensor_beyond_fp16s_range_travels_exact() -> None:
    model = {"big": np.array([1e6, 2.5], np.float32), "w": np.array([1 / 3], np.float32)}
    layouts, _, got = _published(model, "fp16")
    assert [x.encoding is None for x in layouts] == [True, False]
    np.testing.assert_array_equal(got["big"], model["big"])
    assert got["w"][0] == np.float32(np.float16(1 / 3))


def test_a_torch_model_is_published_and_decoded_as_torch() -> None:
    torch = pytest.importorskip("torch")
    model = {"w": torch.linspace(-1, 1, 10)}
    words, encoded = encode_model(model, Bf16Codec())
    fd, layouts, _ = to_memfd(words, encoded=encoded)
    got = from_fd(layouts_to_pb(layouts), fd, as_torch=True)
    assert got["w"].dtype == torch.float32
    assert torch.equal(got["w"], model["w"].to(torch.bfloat16).to(torch.float32))


def test_a_snapshot_whose_words_do_not_decode_is_refused_naming_the_tensor() -> None:
    words, encoded = encode_model({"w": np.ones(4, np.float32)}, Fp16Codec())
    dtype, shape, _ = encoded["w"]
    bad = {"w": (dtype, shape, Encoding("fp16", "float16", (0.5,)))}  # fp16 has no scales
    fd, layouts, _ = to_memfd(words, encoded=bad)
    with pytest.raises(CodecError, match=r"tensor 'w' \(fp16\): fp16 has no scales"):
        from_fd(layouts_to_pb(layouts), fd)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("int8", "codec 'int8' does not carry a model (known for a model: none, bf16, fp16)"),
        ("int8:bound=2", "codec 'int8:bound=2' does not carry a model"),
        ("zstd", "unknown codec 'zstd' (known for a model: none, bf16, fp16)"),
        ("topk", "codec 'topk' does not carry a model (known for a model: none, bf16, fp16)"),
        ("fp16:block=2", "codec 'fp16:block=2': unknown parameter 'block=2'"),
    ],
)
def test_params_refuse_a_model_codec_naming_it_and_the_known_ones(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        Params(model_compression=spec)
    assert message in str(info.value) and "(known for a model: none, bf16, fp16)" in str(info.value)


@pytest.mark.parametrize("spec,wire", [(None, ""), ("none", ""), ("fp16", "fp16"), ("bf16", "bf16")])
def test_params_carry_the_model_codec(spec: str | None, wire: str) -> None:
    message = Params(model_compression=spec, compression="int8").to_pb()
    assert message.model_compression == wire and message.compression == "int8:block=256"
    assert Params.from_pb(message).model_compression == (wire or None)


def _model_header(layouts: list[Layout], total: int, **fields: Any) -> Any:
    return FrameHeader(kind=_MODEL, payload_bytes=total, tensors=layouts_to_pb(layouts), **fields)


def test_the_frame_check_takes_an_encoded_model_whole_and_in_pieces() -> None:
    layouts, total, _ = _published(_model(), "fp16")
    check_header(_model_header(layouts, total), FrameLimits())
    # the first piece carries the layout of the whole (smaller than raw) model
    check_header(_model_header(layouts, 1000, model_bytes=total), FrameLimits())
    check_header(
        FrameHeader(kind=_MODEL, payload_bytes=total - 1000, range_offset=1000, model_bytes=total),
        FrameLimits(),
    )
    with pytest.raises(FrameError, match="out of range"):
        check_header(_model_header(layouts, 1000, model_bytes=total, range_offset=total - 999), FrameLimits())


@pytest.mark.parametrize(
    "encoding,message",
    [
        (Encoding("fp16", "int8"), "bad encoding: words: tensor 'w' (fp16): expected float16, got 'int8'"),
        (Encoding("fp16", "float16", (0.1,)), "bad encoding: scales: tensor 'w' (fp16): fp16 has no scales"),
        (Encoding("gzip", "float16"), "bad encoding: codec: tensor 'w' (gzip): unknown codec 'gzip'"),
        (Encoding("bf16", "uint16", (), 0, 0.0, 2), "its words sum 2 updates, the frame carries 1"),
    ],
)
def test_a_corrupt_encoded_model_frame_is_refused_naming_the_problem(
    encoding: Encoding, message: str
) -> None:
    nbytes = 8 if encoding.words != "int8" else 4
    layout = Layout("w", "float32", (4,), 0, nbytes, encoding)
    with pytest.raises(FrameError) as info:
        check_header(_model_header([layout], nbytes), FrameLimits())
    assert message in str(info.value)


def test_words_that_do_not_cover_the_model_are_refused() -> None:
    layout = Layout("w", "float32", (4,), 0, 16, Encoding("fp16", "float16"))  # raw size, not words
    with pytest.raises(FrameError, match=r"nbytes 16 != 4 elements x 2 bytes \(float16"):
        check_header(_model_header([layout], 16), FrameLimits())


def test_only_updates_and_models_travel_encoded() -> None:
    layout = Layout("w", "float32", (4,), 0, 8, Encoding("fp16", "float16"))
    header = FrameHeader(kind=_ACK, payload_bytes=8, tensors=layouts_to_pb([layout]))
    with pytest.raises(FrameError, match="only an UPDATE's or a MODEL's tensors travel encoded"):
        check_header(header, FrameLimits())


def test_the_model_bytes_served_are_counted_by_codec_pieces_included() -> None:
    counters = Counters()
    layouts, total, _ = _published(_model(), "fp16")
    raw = 64 * 33 * 4 + 17 * 8 + 5 * 2
    first = _model_header(layouts, 1000, job="j", server="ps", version=2, model_bytes=total)
    counters.model(first, 1000)
    rest = FrameHeader(kind=_MODEL, job="j", server="ps", version=2, range_offset=1000, model_bytes=total)
    counters.model(rest, total - 1000)
    counters.model(_model_header(layouts, total, job="j", server="ps", version=3), total)
    plain, plain_total, _ = _published(_model(), None)
    counters.model(_model_header(plain, plain_total, job="k", server="ps", version=1), plain_total)
    stats = counters.snapshot("ps")
    assert stats.model_bytes_served == {"fp16": 2 * total, "none": raw}
    served = stats.model_raw_bytes_served
    assert served == {"none": raw, "fp16": 2 * raw}  # a piece: its share, by its range


def test_an_encoded_model_crosses_a_socket_and_a_corrupt_one_is_refused_there() -> None:
    model = _model()
    words, encoded = encode_model(model, Fp16Codec())
    layouts, total = plan_layout(words, encoded)
    payload = bytearray(total)
    encode_into(memoryview(payload), words, layouts)
    a, b = socket.socketpair()
    try:
        a.settimeout(10)
        b.settimeout(10)
        send_frame(a, _model_header(layouts, total, job="j", server="ps", version=4), payload)
        frame = recv_frame(b, FrameLimits())
        assert frame is not None and frame.header.version == 4
        got = decode(frame.payload, layouts_from_pb(frame.header.tensors))
        np.testing.assert_array_equal(got["w"], Fp16Codec().decode(Fp16Codec().encode(model["w"])))
        # the same frame with its words said to be int8: the receiver refuses it, naming why
        corrupt = _model_header(layouts, total, job="j", server="ps", version=5)
        corrupt.tensors[0].encoding.words = "int8"
        raw = corrupt.SerializeToString()
        a.sendall(MAGIC + struct.pack(">I", len(raw)) + raw + bytes(payload))
        with pytest.raises(
            FrameError, match=r"bad encoding: words: tensor 'w' \(fp16\): expected float16"
        ) as info:
            recv_frame(b, FrameLimits())
        assert info.value.reply_possible
    finally:
        a.close()
        b.close()
