"""The torchrun tier's fixtures."""

import pytest

from ..conftest import close_pools


@pytest.fixture(scope="package", autouse=True)
def warm_ranks_end_with_the_tier():
    """The warm ranks serve this tier; they end with it, not with the session, so that the tiers
    after it do not share the CPU with idle ranks."""
    yield
    close_pools()
