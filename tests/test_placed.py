"""Placed reads (storage/placed.py): a frame file read, hashed and scattered into its
place in one pass, by the compiled helper and by its Python twin, byte for byte the
same; every bad length an error and nothing placed; a place that does not fit refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.storage import codec, placed
from prefixcache.storage.placed import Place, read_placed

KEY = b"k" * 32
IMPLS = ["native", "python"]


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "native":
        if not placed.NATIVE:
            pytest.skip("the compiled _placed helper is not built (no C compiler)")
    else:
        monkeypatch.setattr(placed, "_placed", None)
    yield request.param


def frame_file(path: Path, kv: np.ndarray) -> bytes:
    tokens = np.arange(kv.shape[3], dtype="<u4").tobytes()
    frame = codec.encode(KEY, tokens, kv)
    path.write_bytes(frame)
    return frame


def place_for(out: np.ndarray, at: int, frame_tokens: int, use: int) -> Place:
    layers, kv, heads, length, dim = out.shape
    item = out.itemsize
    return Place(
        out.reshape(-1).view(np.uint8).data,
        at * dim * item,
        layers * kv * heads,
        frame_tokens * dim * item,
        use * dim * item,
        length * dim * item,
    )


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    dim=st.integers(1, 9),
    tokens=st.integers(1, 6),
    data=st.data(),
)
def test_the_rows_land_in_their_place_and_nothing_else_moves(
    tmp_path_factory: pytest.TempPathFactory, layers: int, heads: int, dim: int, tokens: int, data: st.DataObject
) -> None:
    use = data.draw(st.integers(0, tokens), label="use")
    length = data.draw(st.integers(use, use + 8), label="length")
    at = data.draw(st.integers(0, length - use), label="at")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    kv = rng.standard_normal((layers, 2, heads, tokens, dim)).astype(np.float16)
    path = tmp_path_factory.mktemp("placed") / "frame.blk"
    frame = frame_file(path, kv)
    results = []
    for impl in IMPLS:
        if impl == "native" and not placed.NATIVE:
            continue
        out = np.full((layers, 2, heads, length, dim), 7, np.float16)
        saved, placed._placed = placed._placed, (placed._placed if impl == "native" else None)
        try:
            got = read_placed(str(path), bytearray(len(frame) + 100), place_for(out, at, tokens, use))
        finally:
            placed._placed = saved
        assert bytes(got.frame) == frame
        assert got.checksum == xxhash.xxh3_128_digest(kv.tobytes())
        want = np.full_like(out, 7)
        want[:, :, :, at : at + use, :] = kv[:, :, :, :use, :]
        assert np.array_equal(out.view(np.uint16), want.view(np.uint16))
        results.append(out)
    assert all(np.array_equal(r.view(np.uint16), results[0].view(np.uint16)) for r in results)


def test_a_frame_checks_against_the_checksum_computed_on_the_way(tmp_path: Path, impl: str) -> None:
    kv = np.random.default_rng(1).standard_normal((2, 2, 1, 4, 8)).astype(np.float16)
    path = tmp_path / "f.blk"
    frame = bytearray(frame_file(path, kv))
    tokens = np.arange(4, dtype="<u4").tobytes()
    out = np.zeros_like(kv)
    got = read_placed(str(path), bytearray(len(frame)), place_for(out, 0, 4, 4))
    codec.decode(got.frame, key=KEY, tokens=tokens, computed_checksum=got.checksum)
    frame[-3] ^= 0x40  # one flipped payload bit: placed, but its checksum cannot match
    path.write_bytes(bytes(frame))
    got = read_placed(str(path), bytearray(len(frame)), place_for(out, 0, 4, 4))
    with pytest.raises(codec.CorruptFrame, match="payload checksum"):
        codec.decode(got.frame, key=KEY, tokens=tokens, computed_checksum=got.checksum)


@pytest.mark.parametrize("cut", ["short", "long", "empty"])
def test_a_file_of_an_impossible_length_is_refused_and_nothing_placed(tmp_path: Path, impl: str, cut: str) -> None:
    kv = np.ones((1, 2, 1, 4, 4), np.float16)
    path = tmp_path / "f.blk"
    frame = frame_file(path, kv)
    body = {"short": frame[: kv.nbytes - 1], "long": frame + bytes(200), "empty": b""}[cut]
    path.write_bytes(body)
    out = np.zeros_like(kv)
    error = codec.TruncatedFrame if cut != "long" else codec.CorruptFrame
    with pytest.raises(error):
        read_placed(str(path), bytearray(len(frame) + 100), place_for(out, 0, 4, 4))
    assert not out.any()


def test_a_missing_file_is_an_os_error(tmp_path: Path, impl: str) -> None:
    out = np.zeros((1, 2, 1, 4, 4), np.float16)
    with pytest.raises(FileNotFoundError):
        read_placed(str(tmp_path / "gone.blk"), bytearray(4096), place_for(out, 0, 4, 4))


@pytest.mark.parametrize(
    ("offset", "rows", "src_row", "copy_row", "stride"),
    [(0, 0, 8, 8, 8), (-1, 1, 8, 8, 8), (0, 1, 8, 9, 16), (0, 2, 8, 8, 4), (1, 2, 8, 8, 8), (0, 3, 8, 8, 8)],
)
def test_a_place_that_does_not_fit_its_output_is_refused(
    offset: int, rows: int, src_row: int, copy_row: int, stride: int
) -> None:
    out = bytearray(16)
    with pytest.raises(ValueError):
        Place(memoryview(out), offset, rows, src_row, copy_row, stride)


def test_the_compiled_helper_checks_its_bounds_itself() -> None:
    if not placed.NATIVE:
        pytest.skip("the compiled _placed helper is not built")
    assert placed._placed is not None
    with pytest.raises(ValueError, match="do not fit"):
        placed._placed.read_placed("/nonexistent", bytearray(64), memoryview(bytearray(16)), 0, 3, 8, 8, 8)
