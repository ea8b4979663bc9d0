"""A structured line that follows another rank's unfinished text on the same line is still read
by the launcher (a real torchrun launch)."""

from neuron_parallel.testing.ranks import run_ranks


def test_a_rank_result_after_another_ranks_unfinished_line_is_still_read(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, sys\n"
        "from neuron_parallel.testing.ranks import print_rank_result\n"
        "os.write(1, b'step 3 loss 2.1')\n"  # text whose newline has not been written yet
        "print_rank_result({'ok': True})\n"
        "os.write(1, b'\\n')\n"
    )
    r = run_ranks(script, 1)
    assert r.returncode == 0, r.tail()
    assert r.results == [{"rank": 0, "ok": True}]
    assert "step 3 loss 2.1" in r.stdout
