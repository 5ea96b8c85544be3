"""moga.files, the one way moga writes in a run or sweep directory: a symlink is replaced or refused, never
written through; a failed write leaves the previous file; new files keep the usual permissions."""

import os
import stat

import pytest

from moga.files import UnsafeFile, open_append, open_lock, replacing, write_json, write_text


@pytest.fixture
def planted(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("precious\n")
    link = tmp_path / "dir" / "file"
    link.parent.mkdir()
    link.symlink_to(outside)
    return link, outside


def test_whole_files_replace_a_symlink(planted):
    link, outside = planted
    write_json(link, {"a": 1})
    assert outside.read_text() == "precious\n"
    assert not link.is_symlink() and link.read_text() == '{\n "a": 1\n}\n'


@pytest.mark.parametrize("opener", [open_append, open_lock])
def test_appends_and_locks_refuse_a_symlink(planted, opener):
    link, outside = planted
    with pytest.raises(UnsafeFile, match=f"{link} is a symlink; moga never writes through one"):
        opener(link)
    assert outside.read_text() == "precious\n"


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "result.json"
    write_text(path, "old\n")
    with pytest.raises(RuntimeError):
        with replacing(path) as f:
            f.write("half")
            raise RuntimeError("disk full")
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


@pytest.mark.parametrize("opener", [open_append, open_lock])
def test_appends_and_locks_refuse_a_hard_link(tmp_path, opener):
    outside = tmp_path / "outside"
    outside.write_text("precious\n")
    (tmp_path / "run").mkdir()
    os.link(outside, tmp_path / "run" / "metrics.jsonl")  # O_NOFOLLOW does not see a hard link
    with pytest.raises(UnsafeFile, match="a hard link to another file"):
        opener(tmp_path / "run" / "metrics.jsonl")
    assert outside.read_text() == "precious\n"


def test_a_fifo_is_not_a_file_to_append_to(tmp_path):
    os.mkfifo(tmp_path / "metrics.jsonl")
    with pytest.raises(UnsafeFile, match="not a regular file"):
        open_append(tmp_path / "metrics.jsonl")


def test_new_files_get_the_umask_permissions(tmp_path):
    old = os.umask(0o022)
    os.umask(old)
    write_text(tmp_path / "config.yaml", "a: 1\n")
    assert stat.S_IMODE((tmp_path / "config.yaml").stat().st_mode) == 0o666 & ~old
