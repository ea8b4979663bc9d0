"""``launch.first_step_timeout_s``: until a start's first step is done (graphs compile then) the
mesh groups' collectives wait that long for a peer; from then on ``launch.timeout_s``."""

import json

from ..conftest import torchrun, write_job
from .dist_timeout_check import HOOK


def test_the_groups_wait_launch_timeout_s_once_the_first_step_is_done(tiny_world, tiny_dataset, tmp_path):
    train = dict(max_steps=2, save_every=1, keep_checkpoints=0, micro_batch_size=2, report_to=[])
    path = write_job(tmp_path, tiny_world["model"], tiny_dataset.path, world=2, parallel={"tp": 2}, train=train)
    job = json.loads(path.read_text())
    job["launch"].update(timeout_s=45.0, first_step_timeout_s=600.0)
    path.write_text(json.dumps(job))
    r = torchrun(path, 2, hooks=[HOOK], timeout=300)
    assert r.returncode == 0, r.tail()
    assert sorted((x["rank"], x["step"]) for x in r.results) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    # The groups were made with 600 s (train_job); after step 1, before its checkpoint, they wait 45 s.
    assert all(x["timeouts"] == {"dp": 45.0, "pp": 45.0, "tp": 45.0} for x in r.results), r.results
