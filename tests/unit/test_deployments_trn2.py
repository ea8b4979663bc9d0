"""Structure of the `trn2` Kubernetes work pool: deployments/trn2/base-job-template.json and cluster.yaml.

No cluster and no network: the template is rendered the way Prefect's worker renders it (schema defaults,
then `prefect.utilities.templating.apply_values`), and by prefect-kubernetes' own worker job configuration
for a flow run; every object is checked against the Kubernetes API's models (the `kubernetes` client's);
the pod's shell entrypoint is run with /bin/sh."""

from __future__ import annotations

import asyncio
import copy
import difflib
import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_PATH = ROOT / "deployments" / "trn2" / "base-job-template.json"
CLUSTER_PATH = ROOT / "deployments" / "trn2" / "cluster.yaml"
DRA_PATH = ROOT / "deployments" / "trn2" / "dra.yaml"
DOCKERFILE_PATH = ROOT / "deployments" / "trn2" / "Dockerfile"
DEPLOYMENTS_PATH = ROOT / "deployments" / "prefect.yaml"

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
    "logical_nc_config",
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
    assert props["neuron_devices"]["default"] == "16"  # Kubernetes quantities: strings
    assert props["efa_interfaces"]["default"] == "16"
    assert props["shm_size"]["default"] == "64Gi"
    assert props["fsx_claim"]["default"] == "fsx-claim"
    assert props["output_mount"]["default"] == "/fsx"
    assert props["logical_nc_config"]["default"] == "2" and props["logical_nc_config"]["enum"] == ["1", "2"]
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
        assert c["resources"][part]["aws.amazon.com/neuron"] == "16"
        assert c["resources"][part]["vpc.amazonaws.com/efa"] == "16"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert "cpu" not in c["resources"]["limits"]  # no default limit


def test_overrides_reach_the_manifest(template):
    cfg = render(
        template,
        nnodes=4,
        neuron_devices="8",
        output_mount="/mnt/out",
        fsx_claim="other",
        shm_size="8Gi",
        namespace="ns2",
    )
    spec = cfg["job_manifest"]["spec"]
    assert spec["completions"] == spec["parallelism"] == 4
    c = container(cfg)
    assert c["resources"]["limits"]["aws.amazon.com/neuron"] == "8"
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


# What prefect-kubernetes' worker makes of the template for a flow run, checked against the Kubernetes API.

PREFECT_POD_KEYS = {"spec.template.spec.parallelism", "spec.template.spec.completions"}
"""Keys prefect-kubernetes' worker requires in every job template (its manifest check diffs against a base
that has them) though a PodSpec has no such fields; the API server drops them, with a warning under its
default field validation (Warn). test_the_worker_requires_its_pod_keys shows they are still required."""


def unknown_fields(data, type_name: str, path: str = "") -> list[str]:
    """Keys of ``data`` that the Kubernetes API type ``type_name`` (a ``kubernetes.client`` model name, or
    ``List[...]`` / ``Dict[str, ...]`` of one) has no field for, at any depth, each with its path and the
    nearest field names. Written here because the client's deserializer builds a model from the keys it
    knows and silently drops the others, as the API server does under its default field validation."""
    from kubernetes.client import models

    if type_name.startswith("List[") and isinstance(data, list):
        return [p for i, item in enumerate(data) for p in unknown_fields(item, type_name[5:-1], f"{path}[{i}]")]
    if type_name.startswith("Dict[str, ") and isinstance(data, dict):
        inner = type_name[len("Dict[str, ") : -1]
        return [p for key, value in data.items() for p in unknown_fields(value, inner, f"{path}.{key}")]
    model = getattr(models, type_name, None)
    if model is None or not isinstance(data, dict):
        return []  # a primitive, an int-or-string (`object`): the deserializer checks those
    fields = {json_key: attr for attr, json_key in model.attribute_map.items()}
    problems = []
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=2)
            problems.append(f"{where}: {type_name} has no field {key!r}" + (f" (did you mean {near}?)" if near else ""))
        else:
            problems += unknown_fields(value, model.openapi_types[fields[key]], where)
    return problems


def k8s_problems(obj: dict, allowed: set[str] = frozenset()) -> list[str]:
    """What the Kubernetes API would refuse in ``obj``, one object of a manifest: the client's model of its
    kind (``V1Job`` for batch/v1 Job) must deserialize it, with strict types and every required field, and
    it must have no field the model lacks, except the paths in ``allowed``."""
    from kubernetes.client import ApiClient

    model = obj["apiVersion"].rsplit("/", 1)[-1].capitalize() + obj["kind"]
    problems = [p for p in unknown_fields(obj, model) if p.split(":", 1)[0] not in allowed]
    try:
        ApiClient().deserialize(json.dumps(obj), model, "application/json")
    except (ValueError, TypeError) as err:  # pydantic's ValidationError is a ValueError
        problems.append(f"{model}: {err}")
    return problems


def worker_job(template: dict, values: dict) -> dict:
    """The Job prefect-kubernetes' worker submits for a flow run of finetune/trn2 whose job variables
    (the deployment's, then the run's) are ``values``: its job configuration built from the pool's
    template and the values, then prepared for the run, as the worker does before creating the Job."""
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.objects import Flow, FlowRun, WorkPool
    from prefect.client.schemas.responses import DeploymentResponse
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    flow = Flow(id=uuid.uuid4(), name="finetune")
    deployment = DeploymentResponse(id=uuid.uuid4(), name="trn2", flow_id=flow.id)
    run = FlowRun(id=uuid.uuid4(), name="brave-otter", flow_id=flow.id, deployment_id=deployment.id)
    # The template refers to no block or Prefect variable, so the client is never called: one that points
    # nowhere proves it (without it, Prefect would start a temporary server to resolve nothing).
    nowhere = PrefectClient(api="http://127.0.0.1:9/api")
    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(template, values, client=nowhere))
    pool = WorkPool(name="trn2", type="kubernetes", base_job_template=template)
    config.prepare_for_flow_run(run, deployment=deployment, flow=flow, work_pool=pool, worker_name="trn2-worker")
    return config.job_manifest


def trn2_job_variables() -> dict:
    (dep,) = [d for d in yaml.safe_load(DEPLOYMENTS_PATH.read_text())["deployments"] if d["name"] == "trn2"]
    return dep["work_pool"]["job_variables"]


EVERY_OPTION = {
    "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/neuron-flows:2026.1",
    "env": {"HF_HOME": "/fsx/hf", "NEURON_RT_LOG_LEVEL": "WARNING"},
    "labels": {"team": "llm"},
    "namespace": "training",
    "nnodes": 4,
    "neuron_devices": "16",
    "efa_interfaces": "8",
    "cpu_limit": "190",
    "memory_limit": "1900Gi",
    "finished_job_ttl": 3600,
    "job_watch_timeout_seconds": 600,
    "tolerations": [{"key": "spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}],
}


@pytest.mark.parametrize("extra", [{}, EVERY_OPTION], ids=["deployment-defaults", "every-option"])
def test_worker_renders_a_valid_kubernetes_job(template, extra):
    job = worker_job(template, {**trn2_job_variables(), **extra})
    assert k8s_problems(job, allowed=PREFECT_POD_KEYS) == []
    assert {p.split(":", 1)[0] for p in unknown_fields(job, "V1Job")} == PREFECT_POD_KEYS
    spec = job["spec"]
    assert spec["completions"] == spec["parallelism"] == extra.get("nnodes", 2)
    (c,) = spec["template"]["spec"]["containers"]
    assert c["args"] == ["prefect", "flow-run", "execute"]  # pod 0's "$@"
    names = [e["name"] for e in c["env"]]
    assert names.index("PREFECT__FLOW_RUN_ID") < names.index("JOB_NAME")  # Prefect's env first, then ours
    assert len(names) == len(set(names))
    assert job["metadata"]["labels"]["prefect.io/flow-run-name"] == "brave-otter"
    assert spec["template"]["metadata"]["labels"]["neuron-flows/role"] == "trainer"  # the Service selects it
    if extra:
        assert job["metadata"]["namespace"] == "training" and spec["ttlSecondsAfterFinished"] == 3600
        assert c["resources"]["limits"] == {
            "aws.amazon.com/neuron": "16",
            "vpc.amazonaws.com/efa": "8",
            "cpu": "190",
            "memory": "1900Gi",
        }
        assert {"name": "HF_HOME", "value": "/fsx/hf"} in c["env"]


def test_the_worker_requires_its_pod_keys(template):
    """Were prefect-kubernetes to stop requiring them, PREFECT_POD_KEYS could leave the template."""
    broken = copy.deepcopy(template)
    del broken["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["parallelism"]
    with pytest.raises(ValueError, match="/spec/template/spec/parallelism"):
        worker_job(broken, trn2_job_variables())


def _pod(t: dict) -> dict:
    return t["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]


def _misspell_volume_mounts(t):
    c = _pod(t)["containers"][0]
    c["volumeMount"] = c.pop("volumeMounts")


def _misspell_pod_labels(t):
    meta = t["job_configuration"]["job_manifest"]["spec"]["template"]["metadata"]
    meta["label"] = meta.pop("labels")


def _string_backoff_limit(t):
    t["job_configuration"]["job_manifest"]["spec"]["backoffLimit"] = "0"


def _string_host_network(t):
    _pod(t)["hostNetwork"] = "false"


def _integer_quantity(t):
    t["variables"]["properties"]["neuron_devices"].update(type="integer", default=16)


def _volume_without_claim_name(t):
    fsx = next(v for v in _pod(t)["volumes"] if v["name"] == "fsx")
    fsx["persistentVolumeClaim"] = {"readOnly": False}


def _env_without_name(t):
    del _pod(t)["containers"][0]["env"][-1]["name"]


@pytest.mark.parametrize(
    "breakage, expected",
    [
        pytest.param(
            _misspell_volume_mounts,
            "containers[0].volumeMount: V1Container has no field 'volumeMount'",
            id="misspell_volume_mounts",
        ),
        pytest.param(
            _misspell_pod_labels,
            "spec.template.metadata.label: V1ObjectMeta has no field 'label'",
            id="misspell_pod_labels",
        ),
        pytest.param(
            _string_backoff_limit,
            "V1JobSpec\nbackoffLimit\n  Input should be a valid integer",
            id="string_backoff_limit",
        ),
        pytest.param(
            _string_host_network, "V1PodSpec\nhostNetwork\n  Input should be a valid boolean", id="string_host_network"
        ),
        pytest.param(
            _integer_quantity, "V1ResourceRequirements\nlimits.`aws.amazon.com/neuron`", id="integer_quantity"
        ),
        pytest.param(
            _volume_without_claim_name, "V1PersistentVolumeClaimVolumeSource\nclaimName", id="volume_without_claim_name"
        ),
        pytest.param(_env_without_name, "V1EnvVar\nname", id="env_without_name"),
    ],
)
def test_a_broken_template_fails_the_validation(template, breakage, expected):
    broken = copy.deepcopy(template)
    breakage(broken)
    problems = k8s_problems(worker_job(broken, trn2_job_variables()), allowed=PREFECT_POD_KEYS)
    assert problems and any(expected in p for p in problems), problems


def test_cluster_objects_are_valid_kubernetes_objects(cluster):
    for kind, obj in cluster.items():
        assert k8s_problems(obj) == [], kind
    broken = copy.deepcopy(cluster["Service"])
    broken["spec"]["publishNotReadyAdresses"] = broken["spec"].pop("publishNotReadyAddresses")
    assert k8s_problems(broken) == [
        "spec.publishNotReadyAdresses: V1ServiceSpec has no field 'publishNotReadyAdresses'"
        " (did you mean ['publishNotReadyAddresses']?)"
    ]


# The trn2 pods' compile cache and logical NeuronCore setting, and what the planner makes of it.


def trn2_parameters() -> dict:
    (dep,) = [d for d in yaml.safe_load(DEPLOYMENTS_PATH.read_text())["deployments"] if d["name"] == "trn2"]
    return dep["parameters"]["config"]


def _mount_of(job: dict, path: str) -> tuple[dict, dict]:
    """The volume mount of the pod's container that holds ``path`` (the longest prefix), and its volume."""
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    mounts = [
        m for m in c["volumeMounts"] if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert mounts, f"{path} is on no mounted volume"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return mount, volume


@pytest.mark.parametrize("lnc", [None, "1"], ids=["deployment", "lnc1"])
def test_neff_cache_is_on_the_shared_volume_and_the_lnc_is_set(template, cluster, lnc):
    from neuron_parallel.planning.hardware import LNC_ENV, get_hardware

    values = {**trn2_job_variables(), **({"logical_nc_config": lnc} if lnc else {})}
    job = worker_job(template, values)
    (c,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    cache = env["TORCH_NEURONX_NEFF_CACHE_DIR"]
    mount, volume = _mount_of(job, cache)
    assert volume["persistentVolumeClaim"]["claimName"] == cluster["PersistentVolumeClaim"]["metadata"]["name"]
    assert cluster["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]  # every pod, every node
    assert cache != mount["mountPath"] and "$(" not in cache  # a folder of its own, the same in every pod
    assert env[LNC_ENV] == (lnc or trn2_job_variables()["logical_nc_config"])
    hw = get_hardware("trn2.48xlarge", lnc=int(env[LNC_ENV]))
    assert hw.lnc == int(env[LNC_ENV]) and hw.ranks_per_node * hw.lnc == 128  # 16 chips × 8 physical cores
    if lnc is None:  # what the deployment runs: its ranks are the planner's at its LNC
        assert trn2_parameters()["launch"]["nproc_per_node"] == hw.ranks_per_node == 64


def test_the_deployments_first_step_may_wait_longer_than_the_rest(template, monkeypatch):
    """The flow's parameters as pod 0 loads them, with the rendezvous endpoint its environment names."""
    from neuron_flows.tasks.config import FinetuneConfig

    env = env_of(container(render(template)))
    monkeypatch.setenv("NEURON_FLOWS_RDZV_ENDPOINT", env["NEURON_FLOWS_RDZV_ENDPOINT"]["value"])
    launch = FinetuneConfig.model_validate(trn2_parameters()).to_launch()
    assert launch.first_step_timeout_s == launch.start_timeout_s == 5400
    assert launch.timeout_s < launch.start_timeout_s


def test_no_resource_claim_unless_the_cluster_uses_one(template):
    job = worker_job(template, trn2_job_variables())
    pod = job["spec"]["template"]["spec"]
    assert "resourceClaims" not in pod and "claims" not in pod["containers"][0]["resources"]


def test_a_dra_claim_of_the_lnc_renders_a_valid_job(template):
    """The job variables dra.yaml names: its claim template of the deployment's LNC, no device-plugin resource."""
    templates = {d["metadata"]["name"]: d for d in yaml.safe_load_all(DRA_PATH.read_text()) if d}
    lnc = trn2_job_variables()["logical_nc_config"]
    name = f"trn2-neurons-lnc{lnc}"
    values = {
        **trn2_job_variables(),
        "neuron_devices": "0",
        "pod_resource_claims": [{"name": "neurons", "resourceClaimTemplateName": name}],
        "container_resource_claims": [{"name": "neurons"}],
    }
    job = worker_job(template, values)
    assert k8s_problems(job, allowed=PREFECT_POD_KEYS) == []
    pod = job["spec"]["template"]["spec"]
    (claim,) = pod["resourceClaims"]
    assert pod["containers"][0]["resources"]["claims"] == [{"name": claim["name"]}]
    assert pod["containers"][0]["resources"]["limits"]["aws.amazon.com/neuron"] == "0"
    (config,) = templates[claim["resourceClaimTemplateName"]]["spec"]["spec"]["devices"]["config"]
    assert str(config["opaque"]["parameters"]["logicalNeuronCore"]) == lnc


def test_dra_claim_templates_are_valid_and_name_their_lnc():
    docs = [d for d in yaml.safe_load_all(DRA_PATH.read_text()) if d]
    assert {d["metadata"]["name"] for d in docs} == {"trn2-neurons-lnc1", "trn2-neurons-lnc2"}
    for doc in docs:
        assert k8s_problems(doc) == [], doc["metadata"]["name"]
        assert doc["metadata"]["namespace"] == "neuron-flows"
        (config,) = doc["spec"]["spec"]["devices"]["config"]
        assert doc["metadata"]["name"].endswith(f"lnc{config['opaque']['parameters']['logicalNeuronCore']}")
        (request,) = doc["spec"]["spec"]["devices"]["requests"]
        assert request["exactly"]["allocationMode"] == "All" and config["requests"] == [request["name"]]


def _dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE_PATH.read_text(), flags=re.M))


def test_the_images_torch_and_torch_neuronx_are_named_once_and_pair():
    """The Dockerfile names both versions; they satisfy the project's requirements and pair."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    from neuron_parallel.doctor_stack import neuronx_pairs

    args = _dockerfile_args()
    torch_version, neuronx = args["TORCH_VERSION"], args["TORCH_NEURONX_VERSION"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_req,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
    (neuronx_req,) = [Requirement(r) for r in project["optional-dependencies"]["neuron"]]
    assert neuronx_req.name == "torch-neuronx"
    assert Version(torch_version) in torch_req.specifier
    assert Version(neuronx.replace("*", "0")) in neuronx_req.specifier
    assert neuronx_pairs(torch_version, neuronx) and not neuronx_pairs("2.14.0", neuronx)
    text = DOCKERFILE_PATH.read_text()
    assert text.count("2.13") == 2 and '"torch==${TORCH_VERSION}"' in text  # nowhere else in the file
    assert "/opt/neuron-flows" in text and "/opt/neuron-flows" in DEPLOYMENTS_PATH.read_text()
