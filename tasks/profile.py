"""profile_model: what the planner needs to know about the model, cached in the job's storage."""

from __future__ import annotations

import hashlib
import json

from prefect import task
from prefect.logging import get_run_logger

from specs import JobSpec
from storage import JobPaths, ObjectStore
from tasks.credentials import environment, storage_environment
from tasks.records import ModelSummary


def profile_key(spec: JobSpec) -> str:
    """Profiles go stale when the model or the device kind changes, and only then."""
    basis = json.dumps({"model": spec.model.model_dump(), "kind": spec.resources.kind}, sort_keys=True)
    return hashlib.sha256(basis.encode()).hexdigest()[:16]


def summarize_model(spec: JobSpec) -> ModelSummary:
    """Parameter count and training FLOPs per token, from the model built on the meta device."""
    import torch

    from trainer.model import GPT, GPTConfig, flops_per_token

    config = GPTConfig(**{name: getattr(spec.model, name) for name in GPTConfig.__dataclass_fields__})
    with torch.device("meta"):
        model = GPT(config)
    params = model.num_params()
    return ModelSummary(params=params, flops_per_token=flops_per_token(config, params), device_kind=spec.resources.kind)


@task(name="profile-model", retries=2, retry_delay_seconds=2)
def profile_model(spec: JobSpec) -> ModelSummary:
    """Profile the model, or reuse the profile stored for the same model and device kind."""
    logger = get_run_logger()
    key = JobPaths(spec.job_id).profile(profile_key(spec))
    with environment(storage_environment(spec)):
        store = ObjectStore(spec.storage.url, dict(spec.storage.storage_options))
        if store.exists(key):
            logger.info("reusing profile %s", store.url_for(key))
            return ModelSummary.model_validate(store.get_json(key))
        summary = summarize_model(spec)
        store.put_json(key, summary.model_dump())
    logger.info("model: %s parameters, %s FLOPs per token", f"{summary.params:,}", f"{summary.flops_per_token:,}")
    return summary
