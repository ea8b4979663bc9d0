"""A torn line never stops a run: the tail of metrics.jsonl cut short by a crash, or an event
line that another rank's output broke into (a rank's result after another rank's unfinished text
is read by a real launch in tests/dist/test_rank_lines.py)."""

import json

from neuron_parallel.launch import EVENT_PREFIX, read_event
from neuron_parallel.reporting import read_metrics
from neuron_parallel.train import _truncate_metrics


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
    assert read_event(whole) == {"event": "step", "step": 3}
    assert read_event(whole[:25] + "[rank1] loading weights") is None
    assert read_event("plain output") is None and read_event(EVENT_PREFIX + "[1, 2]") is None
    # Another rank printed its text but not yet its newline when this line was written whole.
    assert read_event("[rank1] step 3 loss 2.1" + whole) == {"event": "step", "step": 3}
