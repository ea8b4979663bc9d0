"""A torn line never stops a run: the tail of metrics.jsonl cut short by a crash, or an event
line that another rank's output broke into; and a structured line that follows another rank's
unfinished text on the same line is still read."""

import json

from neuron_parallel.launch import EVENT_PREFIX, _event, run_ranks
from neuron_parallel.train import _truncate_metrics, read_metrics


def test_a_torn_last_metrics_line_is_skipped_and_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": s, "loss": 2.0 - s / 10} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 4, "lo')  # power cut mid-write
    assert read_metrics(path) == records
    _truncate_metrics(path, 2)
    assert read_metrics(path) == records[:2]
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in records[:2])
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # rewritten through a renamed file


def test_an_event_line_broken_by_other_output_is_output_not_a_failure():
    whole = EVENT_PREFIX + json.dumps({"event": "step", "step": 3})
    assert _event(whole) == {"event": "step", "step": 3}
    assert _event(whole[:25] + "[rank1] loading weights") is None
    assert _event("plain output") is None and _event(EVENT_PREFIX + "[1, 2]") is None
    # Another rank printed its text but not yet its newline when this line was written whole.
    assert _event("[rank1] step 3 loss 2.1" + whole) == {"event": "step", "step": 3}


def test_a_rank_result_after_another_ranks_unfinished_line_is_still_read(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, sys\n"
        "from neuron_parallel.launch import print_rank_result\n"
        "os.write(1, b'step 3 loss 2.1')\n"  # text whose newline has not been written yet
        "print_rank_result({'ok': True})\n"
        "os.write(1, b'\\n')\n"
    )
    r = run_ranks(script, 1)
    assert r.returncode == 0, r.tail()
    assert r.results == [{"rank": 0, "ok": True}]
    assert "step 3 loss 2.1" in r.stdout
