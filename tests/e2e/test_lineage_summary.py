"""A recurring fine-tune says in its summary what changed since its previous run: each run leaves
its model's and data's identities as a Prefect artifact keyed by the sources' names, and the next
run of the same model on the same sources compares its own against the newest (real Prefect
server, real flow runs)."""

from __future__ import annotations

import uuid

from prefect.client.orchestration import get_client

from neuron_parallel.lineage import run_lineage


def _lineage(data_commit: str, *, model: str = "org/base", source: str = "org/data") -> dict:
    data = {"source": {"key": "data.source", "repo": source, "commit": data_commit}, "fingerprint": data_commit[:8]}
    return run_lineage({"repo": model, "commit": "b" * 40}, data)


def test_a_run_names_the_revisions_that_changed_since_the_previous_run(prefect_server):
    from prefect import flow

    from neuron_flows.tasks.report import since_previous_run

    @flow
    def occurrence(lineage: dict) -> str | None:
        return since_previous_run(lineage)

    def run(lineage: dict) -> tuple[str | None, str]:
        state = occurrence(lineage, return_state=True)
        with get_client(sync_client=True) as client:
            return state.result(), client.read_flow_run(state.state_details.flow_run_id).name

    first, second = "1" * 40, "2" * 40
    model = f"org/base-{uuid.uuid4().hex[:8]}"  # sources no other test's runs name
    said, one = run(_lineage(first, model=model))
    assert said == "first run of this model on these sources"
    said, two = run(_lineage(first, model=model))
    assert said == f"unchanged since flow run `{one}`", said
    said, _ = run(_lineage(second, model=model))
    change = f"data.source: org/data at commit {first} → org/data at commit {second}"
    assert said == f"changed since flow run `{two}`: {change}", said
    # Other sources are another fine-tune: nothing to compare with.
    assert run(_lineage(second, model=model, source="org/other"))[0] == "first run of this model on these sources"
    assert occurrence({}) is None
