"""The torchrun tier's fixtures."""

import pytest

from ..conftest import close_pools


@pytest.fixture(scope="package", autouse=True)
def warm_ranks_end_with_the_tier():
    """The warm ranks serve this tier; they end with it, not with the session, so that the tiers
    after it do not share the CPU with idle ranks."""
    yield
    close_pools()


def chatml_rows(tiny_world: dict, cache_dir, block_size: int):
    """The tiny world's generated conversations rendered with the bundled ChatML template, packed
    into rows of ``block_size`` tokens, a tenth held out for eval (``tokenize_data``'s result)."""
    from neuron_parallel.config import DataConfig
    from neuron_parallel.data import tokenize_data
    from neuron_parallel.tiny import TEMPLATES

    data = DataConfig(
        source=tiny_world["chat"],
        format="chat",
        chat_template=str(TEMPLATES / "chatml.jinja"),
        block_size=block_size,
        eval_fraction=0.1,
        cache_dir=str(cache_dir),
    )
    return tokenize_data(data, tiny_world["model"])


def train_rows(run_dir, model: str, rows, *, world: int, block_size: int, parallel, train: dict, hooks=()):
    """Train ``model`` on tokenized ``rows`` (their eval rows too) through torchrun in ``run_dir``
    and require success (``hooks``: checkpoint hooks, as ``torchrun`` takes them): the run's metrics
    and the torchrun result."""
    from ..conftest import read_metrics, torchrun, write_job

    job = write_job(
        run_dir,
        model,
        rows.path,
        eval_dataset=rows.eval_path,
        world=world,
        block_size=block_size,
        parallel=parallel,
        train=train,
    )
    proc = torchrun(job, world, timeout=400, hooks=hooks)
    assert proc.returncode == 0, proc.tail()
    return read_metrics(run_dir), proc
