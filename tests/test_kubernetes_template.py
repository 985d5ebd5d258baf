"""docs/kubernetes/parashift-nodes.json, the base job template of a Prefect Kubernetes work pool
for jobs across nodes: accepted by Prefect's own work-pool validation, its variables a valid JSON
Schema, and rendered (as a worker renders it) into a Job that places the launcher pod on its node,
keeps the node-local tier on the host, and never retries a pod (the job re-plans instead)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

TEMPLATE = Path(__file__).resolve().parents[1] / "docs" / "kubernetes" / "parashift-nodes.json"


def render(values: dict[str, Any]) -> dict[str, Any]:
    """The job configuration with the variables' defaults and `values`, as Prefect fills it."""
    from prefect.utilities.templating import apply_values

    template = json.loads(TEMPLATE.read_text())
    variables = template["variables"]
    filled = {k: v["default"] for k, v in variables["properties"].items() if "default" in v} | values
    jsonschema.validate(filled, variables)
    return apply_values(template["job_configuration"], filled)


def test_prefect_accepts_the_template_and_its_variables_are_a_json_schema() -> None:
    from prefect.server.schemas.actions import validate_base_job_template

    template = json.loads(TEMPLATE.read_text())
    validate_base_job_template(template)  # every placeholder is a declared variable
    jsonschema.Draft202012Validator.check_schema(template["variables"])
    with pytest.raises(jsonschema.ValidationError):  # the image is the one thing a user must give
        jsonschema.validate({}, template["variables"])


def test_a_launcher_run_renders_into_a_job_on_its_node() -> None:
    config = render({"image": "registry.example.com/parashift:1", "parashift_node": "gpu-a", "gpus_per_node": 8,
                     "tier_path": "/var/lib/parashift/tier", "command": "prefect flow-run execute",
                     "name": "job-gpu-a"})
    assert "{{" not in json.dumps(config)
    job = config["job_manifest"]
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    assert job["spec"]["backoffLimit"] == 0  # a lost node is the job's to re-plan, not Kubernetes' to retry
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == {"parashift.io/node": "gpu-a"}
    container = pod["containers"][0]
    assert container["image"] == "registry.example.com/parashift:1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["node-local-tier"] == "/var/lib/parashift/tier"
    assert volumes["node-local-tier"]["hostPath"] == {"path": "/var/lib/parashift/tier", "type": "DirectoryOrCreate"}
    assert volumes["shm"] == {"name": "shm", "emptyDir": {"medium": "Memory"}}


def test_the_job_sets_the_variable_the_template_places_pods_by(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every launcher run the job starts carries `parashift_node`, the variable the template reads."""
    import prefect.deployments
    from jobs import tiny_spec
    from parashift.specs.plan import Plan
    from parashift.storage import open_store
    from parashift.tasks.nodes import node_launch

    asked: list[dict[str, Any]] = []

    class Run:
        id = "run-id"

    def run_deployment(name: str, **kwargs: Any) -> Run:
        asked.append({"name": name, **kwargs})
        return Run()

    monkeypatch.setattr(prefect.deployments, "run_deployment", run_deployment)
    spec = tiny_spec("k8s", f"file://{tmp_path}/store", resources={"devices": 4, "nodes": ["gpu-a", "gpu-b"]})
    launch = node_launch(spec, Plan.data_parallel(4), None, open_store(spec.storage))
    for node in ("gpu-a", "gpu-b"):
        launch._start(node, launch.launch_id)
    assert [(a["work_queue_name"], a["job_variables"]) for a in asked] == [
        ("gpu-a", {"parashift_node": "gpu-a"}), ("gpu-b", {"parashift_node": "gpu-b"})]
    assert "parashift_node" in json.loads(TEMPLATE.read_text())["variables"]["properties"]
