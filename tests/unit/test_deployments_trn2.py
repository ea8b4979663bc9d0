"""Structure of the `trn2` Kubernetes work pool: deployments/trn2/base-job-template.json and cluster.yaml.

No cluster and no network: the template is rendered the way Prefect's worker renders it (schema defaults,
then `prefect.utilities.templating.apply_values`), and the pod's shell entrypoint is run with /bin/sh."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_PATH = ROOT / "deployments" / "trn2" / "base-job-template.json"
CLUSTER_PATH = ROOT / "deployments" / "trn2" / "cluster.yaml"

# Keys the Prefect kubernetes worker reads from `job_configuration` (its default template has exactly these).
WORKER_KEYS = {
    "command",
    "env",
    "labels",
    "name",
    "namespace",
    "job_manifest",
    "cluster_config",
    "stream_output",
    "job_watch_timeout_seconds",
    "pod_watch_timeout_seconds",
}
# Placeholders that Prefect itself fills per flow run; its default template declares them as properties too.
PREFECT_BUILTINS = {"command", "env", "labels", "name", "namespace"}
REQUIRED_VARIABLES = {
    "image",
    "namespace",
    "nnodes",
    "neuron_devices",
    "efa_interfaces",
    "shm_size",
    "fsx_claim",
    "output_mount",
    "service_account_name",
    "env",
    "labels",
    "finished_job_ttl",
    "stream_output",
    "job_watch_timeout_seconds",
    "pod_watch_timeout_seconds",
    "cpu_request",
    "memory_request",
    "node_selector",
    "tolerations",
}


@pytest.fixture(scope="module")
def template() -> dict:
    return json.loads(TEMPLATE_PATH.read_text())


@pytest.fixture(scope="module")
def cluster() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(CLUSTER_PATH.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object per kind expected"
    return by_kind


def defaults(template: dict) -> dict:
    """Prefect's BaseJobConfiguration._get_base_config_defaults: every non-None schema default."""
    props = template["variables"]["properties"]
    return {k: p["default"] for k, p in props.items() if p.get("default") is not None}


def render(template: dict, **values) -> dict:
    from prefect.utilities.templating import apply_values

    return apply_values(copy.deepcopy(template["job_configuration"]), {**defaults(template), **values})


def pod_spec(job_configuration: dict) -> dict:
    return job_configuration["job_manifest"]["spec"]["template"]["spec"]


def container(job_configuration: dict) -> dict:
    (c,) = pod_spec(job_configuration)["containers"]
    return c


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c["env"]}


def test_template_shape(template):
    assert set(template) == {"job_configuration", "variables"}
    assert set(template["job_configuration"]) == WORKER_KEYS
    for key in WORKER_KEYS - {"job_manifest"}:
        assert template["job_configuration"][key] == "{{ " + key + " }}"
    props = template["variables"]["properties"]
    assert REQUIRED_VARIABLES <= set(props)
    for name, prop in props.items():
        assert prop.get("description"), f"variable {name} has no description"
    assert props["namespace"]["default"] == "neuron-flows"
    assert props["nnodes"]["type"] == "integer" and props["nnodes"]["default"] == 2
    assert props["neuron_devices"]["default"] == 16
    assert props["efa_interfaces"]["default"] == 16
    assert props["shm_size"]["default"] == "64Gi"
    assert props["fsx_claim"]["default"] == "fsx-claim"
    assert props["output_mount"]["default"] == "/fsx"
    assert props["node_selector"]["default"] == {"node.kubernetes.io/instance-type": "trn2.48xlarge"}
    assert {"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"} in (
        props["tolerations"]["default"]
    )
    assert "neuron" in props["image"]["description"] and props["image"]["default"]


def test_every_placeholder_is_a_declared_variable(template):
    """What the Prefect server checks on `work-pool create` (validate_base_job_template)."""
    from prefect.utilities.templating import find_placeholders

    used = set()
    for value in template["job_configuration"].values():
        used |= {p.name for p in find_placeholders(json.dumps(value))}
    props = set(template["variables"]["properties"])
    assert used - props == set()
    assert PREFECT_BUILTINS <= used  # Prefect's own placeholders stay wired
    assert {"nnodes", "neuron_devices", "efa_interfaces", "shm_size", "fsx_claim", "output_mount"} <= used


def test_rendered_job_is_an_indexed_multi_node_job(template):
    cfg = render(template)
    job = cfg["job_manifest"]
    assert "{{" not in json.dumps(cfg)
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 2
    assert spec["backoffLimit"] == 0
    assert "ttlSecondsAfterFinished" not in spec  # unset variable: removed, as Prefect does
    assert job["metadata"]["namespace"] == "neuron-flows"

    pod = pod_spec(cfg)
    assert pod["restartPolicy"] == "Never"
    assert pod["hostNetwork"] is False
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "trn2.48xlarge"}
    assert any(t["key"] == "aws.amazon.com/neuron" and t["effect"] == "NoSchedule" for t in pod["tolerations"])
    c = container(cfg)
    assert c["name"] == "prefect-job"
    assert c["image"].endswith("/neuron-flows:latest")
    for part in ("limits", "requests"):
        assert c["resources"][part]["aws.amazon.com/neuron"] == 16
        assert c["resources"][part]["vpc.amazonaws.com/efa"] == 16
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert "cpu" not in c["resources"]["limits"]  # no default limit


def test_overrides_reach_the_manifest(template):
    cfg = render(
        template,
        nnodes=4,
        neuron_devices=8,
        output_mount="/mnt/out",
        fsx_claim="other",
        shm_size="8Gi",
        namespace="ns2",
    )
    spec = cfg["job_manifest"]["spec"]
    assert spec["completions"] == spec["parallelism"] == 4
    c = container(cfg)
    assert c["resources"]["limits"]["aws.amazon.com/neuron"] == 8
    assert {"name": "fsx", "mountPath": "/mnt/out"} in c["volumeMounts"]
    vols = {v["name"]: v for v in pod_spec(cfg)["volumes"]}
    assert vols["fsx"]["persistentVolumeClaim"]["claimName"] == "other"
    assert vols["dshm"]["emptyDir"]["sizeLimit"] == "8Gi"
    assert env_of(c)["NEURON_FLOWS_LAUNCH_FILE"]["value"] == "/mnt/out/neuron-flows/launch/$(JOB_NAME).json"
    assert "NEURON_FLOWS_NNODES=4\n" in c["command"][2]
    assert cfg["namespace"] == cfg["job_manifest"]["metadata"]["namespace"] == "ns2"


def test_volumes_shm_and_fsx(template):
    cfg = render(template)
    vols = {v["name"]: v for v in pod_spec(cfg)["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container(cfg)["volumeMounts"]}
    shm = vols[mounts["/dev/shm"]]["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert vols[mounts["/fsx"]]["persistentVolumeClaim"]["claimName"] == "fsx-claim"


def test_env_is_valid_for_kubernetes(template):
    """Every value is a string (the API server rejects numbers) and each $(VAR) names an earlier variable."""
    cfg = render(template)
    env = container(cfg)["env"]
    assert isinstance(env, list)  # a list: Prefect's worker prepends its own `env` to it
    seen: set[str] = set()
    for e in env:
        assert ("value" in e) != ("valueFrom" in e), e
        if "value" in e:
            assert isinstance(e["value"], str), e
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", e["value"]):
                assert ref in seen, f"{e['name']} refers to {ref} before it is defined"
        seen.add(e["name"])
    by_name = env_of(container(cfg))
    assert by_name["JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['batch.kubernetes.io/job-name']"
    )
    assert by_name["NEURON_FLOWS_RDZV_ENDPOINT"]["value"] == "$(JOB_NAME)-0.neuron-flows:29400"
    assert by_name["NEURON_FLOWS_LAUNCH_FILE"]["value"] == "/fsx/neuron-flows/launch/$(JOB_NAME).json"
    assert by_name["FI_PROVIDER"]["value"] == "efa"
    assert by_name["FI_EFA_USE_DEVICE_RDMA"]["value"] == "1"
    assert by_name["FI_EFA_FORK_SAFE"]["value"] == "1"


def test_prefect_worker_manifest_checks(template):
    """The kubernetes worker's _validate_job_manifest diffs against this base: paths must exist with these
    values (the pod-level parallelism/completions are the worker's quirk, kept as in its default template),
    and `args` must be absent, a string or a list so that it can fill in the flow run command."""
    cfg = render(template)
    assert template["job_configuration"]["job_manifest"]["metadata"]["labels"] == "{{ labels }}"
    pod = pod_spec(cfg)
    assert pod["parallelism"] == 1 and pod["completions"] == 1
    assert pod["restartPolicy"] == "Never"
    assert pod["containers"][0]["name"] == "prefect-job"
    assert "args" not in container(cfg)  # `command` unset: the worker fills args itself
    with_command = render(template, command="prefect flow-run execute")
    assert container(with_command)["args"] == "prefect flow-run execute"  # the worker shlex-splits it


def test_cluster_objects_match_the_template(template, cluster):
    assert set(cluster) == {"Namespace", "Service", "ServiceAccount", "PersistentVolumeClaim"}
    cfg = render(template)
    job = cfg["job_manifest"]
    ns = cluster["Namespace"]["metadata"]["name"]
    assert job["metadata"]["namespace"] == ns
    for kind in ("Service", "ServiceAccount", "PersistentVolumeClaim"):
        assert cluster[kind]["metadata"]["namespace"] == ns

    svc = cluster["Service"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert pod_spec(cfg)["subdomain"] == svc["metadata"]["name"]
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"] == {"neuron-flows/role": "trainer"}
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (port,) = svc["spec"]["ports"]
    assert port["name"] == "rdzv" and port["port"] == 29400
    endpoint = env_of(container(cfg))["NEURON_FLOWS_RDZV_ENDPOINT"]["value"]
    assert endpoint.endswith(f".{svc['metadata']['name']}:{port['port']}")

    assert pod_spec(cfg)["serviceAccountName"] == cluster["ServiceAccount"]["metadata"]["name"]
    pvc = cluster["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == template["variables"]["properties"]["fsx_claim"]["default"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["storageClassName"] == "fsx-sc"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "1200Gi"


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs /bin/sh")
@pytest.mark.parametrize("index, expected", [("0", "FLOW run --x"), ("1", "JOIN join"), ("3", "JOIN join")])
def test_entrypoint_runs_flow_on_index_0_and_join_elsewhere(template, tmp_path, index, expected):
    """Run the container's command as Kubernetes would: command + args, with JOB_COMPLETION_INDEX set."""
    c = container(render(template, command="flowcmd run --x"))
    argv = c["command"] + c["args"].split()
    assert argv[:2] == ["/bin/sh", "-c"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, tag in (("neuron-flows", "JOIN"), ("flowcmd", "FLOW")):
        exe = bin_dir / name
        exe.write_text(f'#!/bin/sh\necho "{tag} $* nnodes=$NEURON_FLOWS_NNODES"\n')
        exe.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}", "JOB_COMPLETION_INDEX": index}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{expected} nnodes=2"


def test_entrypoint_refuses_index_0_without_a_command(template):
    c = container(render(template))
    out = subprocess.run(
        c["command"],
        env={"PATH": os.environ.get("PATH", ""), "JOB_COMPLETION_INDEX": "0"},
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert out.returncode != 0
    assert "neuron-flows join" in c["command"][2]
