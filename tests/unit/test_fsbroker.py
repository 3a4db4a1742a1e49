"""Message files of the filesystem transport appear whole (written aside, renamed into place)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection
from kombu.transport import filesystem

from celery_boundedbeat.dispatch.fsbroker import use_whole_files


@pytest.fixture
def restore_put() -> Any:
    original = filesystem.Channel._put
    yield
    filesystem.Channel._put = original  # type: ignore[method-assign]


def test_only_the_filesystem_transport_is_touched(restore_put: Any) -> None:
    original = filesystem.Channel._put
    assert not use_whole_files("amqp://guest:guest@localhost//")
    assert not use_whole_files(None)
    assert filesystem.Channel._put is original
    assert use_whole_files("filesystem://") and use_whole_files("filesystem://")
    assert filesystem.Channel._put is not original


def test_a_message_file_is_renamed_into_place_whole_and_read_back(
    tmp_path: Path, restore_put: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No reader ever lists a message file before its content is in it: the file only gets its
    ``.msg`` name by ``os.replace``, after the write; the consumer reads the message as sent."""
    assert use_whole_files("filesystem://")
    renamed: list[tuple[str, int]] = []
    replace = os.replace

    def spy(src: Any, dst: Any) -> None:
        renamed.append((os.path.basename(str(dst)), os.path.getsize(src)))
        assert not str(src).endswith(".msg")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    folder = str(tmp_path)
    options = {"data_folder_in": folder, "data_folder_out": folder, "control_folder": folder}
    with Connection("filesystem://", transport_options=options) as conn:
        queue = conn.SimpleQueue("whole")
        queue.put({"n": 1})
        got = queue.get(timeout=5)
        assert got.payload == {"n": 1}
        got.ack()
        queue.close()
    assert len(renamed) == 1 and renamed[0][0].endswith(".whole.msg") and renamed[0][1] > 0
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".writing")] == []
