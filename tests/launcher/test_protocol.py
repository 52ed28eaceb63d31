"""The launcher's messages: each kind read back as it was written, a channel's reader refusing what the channel does
not carry, a rank's progress pipe read as whole notices whatever the pipe's chunks, and a rank's progress drawn in
the cell."""
from __future__ import annotations

import os

import pytest

from helpers.launcher import launch, protocol, rank

EVERY_KIND = [protocol.Progress(3, 10, 1.5, {"loss": 0.5}), protocol.Reported("error"), protocol.CallDone(2, "result"),
              protocol.Fork("/tmp/run", 1), protocol.Ready(7, None), protocol.Forked("/tmp/run", 1, 8),
              protocol.Exited(8, -9), protocol.Call(4, "/tmp/run/call.4")]


@pytest.mark.parametrize("message", EVERY_KIND, ids=[type(m).__name__ for m in EVERY_KIND])
def test_each_message_is_read_back_as_written_and_only_on_its_channel(message):
    kinds = (type(message),)
    assert protocol.decode(protocol.encode(message), kinds) == message
    others = tuple(type(m) for m in EVERY_KIND if not isinstance(m, kinds))
    with pytest.raises(ValueError):
        protocol.decode(protocol.encode(message), others)


def test_a_record_with_fields_other_than_its_kinds_is_refused():
    with pytest.raises(ValueError):
        protocol.decode(b'{"kind": "Exited", "pid": 8}', protocol.SERVER_REPLIES)
    with pytest.raises(ValueError):
        protocol.decode(b'{"kind": "Reported", "outcome": "result", "extra": 1}', protocol.NOTICES)


def test_the_kernel_reads_a_ranks_notices_whole_and_drops_lines_that_are_none(monkeypatch):
    read, write = os.pipe()
    reader = protocol.NoticeReader(read)
    try:
        monkeypatch.setenv(protocol.PROGRESS_FD_VAR, str(write))
        rank.report_progress(3, 10, loss=0.5)
        assert protocol.send_notice(protocol.Reported("result"))
        done = protocol.encode(protocol.CallDone(2, "error")) + b"\n"
        os.write(write, b"not json\n" + protocol.encode(protocol.Exited(1, 0)) + b"\n" + done[:5])
        notices, still_open = reader.read()
        os.write(write, done[5:])
        later, _ = reader.read()
    finally:
        reader.close()
        os.close(write)
    progress, reported = notices  # the junk, the other channel's message and the half line are not notices (yet)
    assert (progress.step, progress.total, progress.metrics) == (3, 10, {"loss": 0.5}) and still_open
    assert reported == protocol.Reported("result")
    assert later == [protocol.CallDone(2, "error")]


def test_progress_prints_every_tenth_outside_the_launcher(capsys, monkeypatch):
    monkeypatch.delenv(protocol.PROGRESS_FD_VAR, raising=False)
    monkeypatch.setenv("RANK", "0")
    for step in range(1, 21):
        rank.report_progress(step, 20, loss=1.0 / step)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 10 and lines[-1].startswith("[rank 0] 20/20 loss=0.05")


def test_a_ranks_progress_reaches_the_cells_display(capsys):
    def work(steps):
        import helpers

        for step in range(1, steps + 1):
            helpers.report_progress(step, steps, loss=1.0 / step)
        return step

    assert launch(work, 3, world_size=2, timeout=120) == [3, 3]
    drawn = [line for line in capsys.readouterr().err.splitlines() if line.startswith("progress: ")]
    assert drawn[-1] == "progress: rank 0 3/3 loss=0.3333 | rank 1 3/3 loss=0.3333"
