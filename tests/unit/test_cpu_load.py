"""The bench's gate that waits for a quiet machine before each timed round."""

from draftsmith import cpu_load as quiet


def test_the_quiet_gate_counts_only_other_processes(monkeypatch):
    # this process burning CPU is not "another process": the machine reads quiet
    readings = iter([(100.0, 10.0), (100.5, 10.5)])
    monkeypatch.setattr(quiet, "_cpu_seconds", lambda: next(readings))
    assert quiet.others_busy(0.0001) == 0.0
    # one core busy elsewhere for the whole sample: a round waits, and says so once, then gives up at the limit
    monkeypatch.setattr(quiet, "others_busy", lambda: 1.0)
    said = []
    assert quiet.wait_for_quiet(max_wait_s=0.0, log=said.append) == 1.0
    assert len(said) == 1 and "still busy" in said[0]
