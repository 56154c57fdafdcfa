"""The weights' fingerprint (``prefixcache.weights``): by name and bytes, never framed
alike for two folders, the dtype in it; its memo serves a restart from stamps alone,
and never a digest of bytes a file no longer holds."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.weights import (
    MEMO_FILE,
    DigestMemo,
    WeightsChanged,
    file_digest,
    files_fingerprint,
    folder_content,
    model_key,
    weights_fingerprint,
)

LATER = 10**12  # ns: a clock this far ahead makes every file old enough to memoize


def folder(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


class Counting:
    """``file_digest``, counting the files it reads."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def __call__(self, path: Path) -> bytes:
        self.read.append(path.name)
        return file_digest(path)


def ahead() -> int:
    return time.time_ns() + LATER


def test_two_folders_whose_bytes_concatenate_alike_differ(tmp_path: Path) -> None:
    # one stream of name-prefix + bytes would read the same for both: the old framing did
    one = folder(tmp_path / "one", {"a.bin": b"hello" + b"5:b.bin" + b"world"})
    two = folder(tmp_path / "two", {"a.bin": b"hello", "b.bin": b"world"})
    assert files_fingerprint(one) != files_fingerprint(two)


def test_the_content_covers_config_and_weights_by_name_and_bytes_and_only_them(tmp_path: Path) -> None:
    base = {"config.json": b'{"a": 1}', "model.safetensors": b"x" * 64, "tokenizer.json": b"{}"}
    first = folder_content(folder(tmp_path / "a", base))
    assert first == folder_content(folder(tmp_path / "b", base))  # another folder, the same bytes
    assert first == folder_content(folder(tmp_path / "c", base | {"tokenizer.json": b"[]", "README.md": b"hi"}))
    assert first != folder_content(folder(tmp_path / "d", base | {"config.json": b'{"a": 2}'}))
    assert first != folder_content(folder(tmp_path / "e", base | {"model.safetensors": b"x" * 63 + b"y"}))
    renamed = {"config.json": base["config.json"], "model-00001.safetensors": base["model.safetensors"]}
    assert first != folder_content(folder(tmp_path / "f", renamed))
    assert weights_fingerprint(first, "float32") != weights_fingerprint(first, "bfloat16")
    assert len(weights_fingerprint(first, "float32")) == 16


def test_the_model_key_changes_when_the_weights_or_dtype_change(tmp_path: Path) -> None:
    folder(tmp_path, {"config.json": b"{}", "model.safetensors": b"\0" * 32})
    first = model_key("smol", str(tmp_path), "float32")
    assert first == model_key("smol", str(tmp_path), "float32") and first.startswith("smol@")
    assert model_key("smol", str(tmp_path), "bfloat16") != first
    (tmp_path / "model.safetensors").write_bytes(b"\1" + b"\0" * 31)  # same size, one byte
    assert model_key("smol", str(tmp_path), "float32") != first
    assert model_key("org/smol", "org/smol", "float32", "abc") != model_key("org/smol", "org/smol", "float32", "abd")


def test_a_restart_reads_no_byte_of_unchanged_weights(tmp_path: Path) -> None:
    model = folder(tmp_path / "m", {"config.json": b"{}", "a.safetensors": b"a" * 100, "b.safetensors": b"b" * 100})
    memo_path = tmp_path / MEMO_FILE
    count = Counting()
    memo = DigestMemo(memo_path, clock=ahead, digest=count)
    first = folder_content(model, memo)
    memo.save()
    assert sorted(count.read) == ["a.safetensors", "b.safetensors", "config.json"]
    assert json.loads(memo_path.read_text())["version"] == 1
    restarted = Counting()
    again = DigestMemo(memo_path, clock=ahead, digest=restarted)  # a new process: the file alone
    assert folder_content(model, again) == first and restarted.read == [] and again.computed == 0
    (model / "b.safetensors").write_bytes(b"c" * 101)  # another size: that file alone is read again
    assert folder_content(model, again) != first and restarted.read == ["b.safetensors"]


def test_a_just_written_file_is_never_memoized(tmp_path: Path) -> None:
    model = folder(tmp_path / "m", {"a.bin": b"a"})
    ctime = os.stat(model / "a.bin").st_ctime_ns
    count = Counting()
    memo = DigestMemo(tmp_path / MEMO_FILE, clock=lambda: ctime + 1, digest=count)  # within the racy window
    files_fingerprint(model, memo=memo)
    files_fingerprint(model, memo=memo)
    memo.save()
    assert count.read == ["a.bin", "a.bin"] and not (tmp_path / MEMO_FILE).exists()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=1, max_size=256), at=st.integers(min_value=0), flip=st.integers(1, 255))
def test_a_byte_changed_in_place_at_its_old_mtime_is_read_again(
    tmp_path: Path, data: bytes, at: int, flip: int
) -> None:
    model = folder(tmp_path / f"m{time.monotonic_ns()}", {"model.safetensors": data})
    path = model / "model.safetensors"
    memo = DigestMemo(tmp_path / MEMO_FILE)  # the real clock: the racy rule is what keeps this exact
    before = files_fingerprint(model, memo=memo)
    memo.save()
    st_before = os.stat(path)
    i = at % len(data)
    with path.open("r+b") as f:  # the same inode, the same size
        f.seek(i)
        f.write(bytes([data[i] ^ flip]))
    os.utime(path, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))  # rsync -t, cp -p: the old mtime back
    after = files_fingerprint(model, memo=DigestMemo(tmp_path / MEMO_FILE))
    assert after == files_fingerprint(model) != before  # what a memo-less read gives: the new bytes'


def test_a_file_written_while_it_is_read_gives_no_fingerprint(tmp_path: Path) -> None:
    model = folder(tmp_path / "m", {"a.bin": b"a" * 10})

    def digest_then_grow(path: Path) -> bytes:
        value = file_digest(path)
        with path.open("ab") as f:
            f.write(b"more")
        return value

    with pytest.raises(WeightsChanged, match="changed while it was read"):
        files_fingerprint(model, memo=DigestMemo(digest=digest_then_grow))


@pytest.mark.parametrize("content", ["not json", '{"version": 9, "files": {}}', '{"version": 1, "files": {"x": [1]}}'])
def test_a_corrupt_memo_is_read_as_empty(tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture) -> None:
    model = folder(tmp_path / "m", {"a.bin": b"a"})
    (tmp_path / MEMO_FILE).write_text(content)
    assert files_fingerprint(model, memo=DigestMemo(tmp_path / MEMO_FILE)) == files_fingerprint(model)
    assert "event=weights_memo_unreadable" in caplog.text


def test_a_memo_that_cannot_be_written_costs_a_read_not_a_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = folder(tmp_path / "m", {"a.bin": b"a"})
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the memo's folder should be
    memo = DigestMemo(blocked / MEMO_FILE, clock=ahead)
    value = files_fingerprint(model, memo=memo)
    memo.save()
    assert value == files_fingerprint(model) and "event=weights_memo_unwritable" in caplog.text
