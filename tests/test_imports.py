"""The rooms' import rules, read from the source (no imports executed): no package imports
itself in a circle (counting imports inside functions, which only hide a circle until the
first call), the trainer never imports the planner (the Plan contract lives in `specs`), and
the engines (the launcher among them) never import Prefect, and what a rank runs
(`trainer`) never starts or supervises processes (that is `launcher`'s)."""

from __future__ import annotations

import ast
import json
from collections.abc import Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specs", "corpus", "models", "planner", "ptc", "storage", "trainer", "launcher", "pool", "tasks",
            "flows", "parashift")
# Usable and testable without an orchestrator: no Prefect in any of them.
ENGINES = ("specs", "corpus", "models", "planner", "ptc", "storage", "trainer", "launcher", "pool")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def room_name(module: str) -> str:
    """`parashift.trainer.worker` -> `trainer.worker`: a room's modules by their folder's names."""
    rest = module.removeprefix("parashift.")
    return rest if rest != module and rest.split(".")[0] in PACKAGES else module


def imports_of(path: Path, known: Collection[str]) -> set[str]:
    """Every module `path` imports, at any depth of its code (absolute imports only)."""
    return imports_in(ast.parse(path.read_text()), known)


def imports_in(tree: ast.AST, known: Collection[str]) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(room_name(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            module = room_name(node.module)
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in known)
            if node.module == "parashift":  # `from parashift import ptc`
                out.update(alias.name for alias in node.names if alias.name in known)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v] & edges.keys():
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    edges = {name: {m for m in deps if m != name} for name, deps in graph().items()}
    assert circles(edges) == []


def test_a_circle_is_seen() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_trainer_never_imports_the_planner() -> None:
    bad = {(name, m) for name, deps in graph().items() if name.startswith("trainer") for m in deps
           if m == "planner" or m.startswith("planner.")}
    assert bad == set()


def test_only_a_familys_graph_module_imports_the_planner() -> None:
    """The trainer imports model families, so a family's own modules stay clear of the planner;
    its `graph` module (loaded by the planner's side only) is the one that may not."""
    bad = {(name, m) for name, deps in graph().items() if name.startswith("models") and not name.endswith(".graph")
           for m in deps if m == "planner" or m.startswith("planner.")}
    assert bad == set()


def test_validating_any_familys_spec_imports_no_torch(tmp_path: Path) -> None:
    """`specs` imports every family's spec section to validate `model:`, and resolves a
    checkpoint folder's config: `parashift validate` must not pay torch's import."""
    import subprocess
    import sys

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
        "intermediate_size": 64, "vocab_size": 256}))
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"")  # named, not read, where a spec is read
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: job\nmodel: {{family: llama, init_from: {tmp_path / 'ckpt'}}}\n")
    code = ("import sys; from parashift.specs import load_spec; s = load_spec(sys.argv[1]); assert s.model.d_model == 32; "
            "from parashift.specs import JobSpec; JobSpec.model_validate({'name': 'x', 'model': {'family': 'hf', "
            "'config': {'model_type': 'gpt2'}}}); print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code, str(spec)], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_engines_never_import_prefect() -> None:
    bad = {(name, m) for name, deps in graph().items() if name.split(".")[0] in ENGINES for m in deps
           if m == "prefect" or m.startswith("prefect.")}
    assert bad == set()


# Names of the GPT's (and the Llama's) modules and parameters: they belong to the family folders.
PARAMETER_NAMES = ("tok_emb", "pos_emb", "lm_head", "q_proj", "k_proj", "v_proj", "out_proj", "up_proj", "down_proj",
                   "gate_proj", "attn_norm", "mlp_norm")


def test_only_family_folders_name_model_parameters() -> None:
    """Adding a family touches its folder only: every other room reaches parameters through a
    family's sharding table (models/sharding.py), never by name."""
    import re

    pattern = re.compile(r"\b(" + "|".join(PARAMETER_NAMES) + r")\b|\bblocks\.(\d|<|\{)")
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for name, path in modules().items()
             if not name.startswith("models") for i, line in enumerate(path.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert found == []


def test_every_module_imports_the_rooms_by_their_installed_name() -> None:
    """`from parashift.specs import ...`, never `from specs import ...`: a bare room name would
    import a user's folder of that name, or a second copy of parashift's own module."""
    rooms = (*PACKAGES[:-1], "bench")
    bare = [f"{path.relative_to(ROOT)}:{node.lineno}" for folder in (*PACKAGES, "bench", "tests")
            for path in (ROOT / folder).rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] in rooms)
            or (isinstance(node, ast.Import) and any(a.name.split(".")[0] in rooms for a in node.names))]
    assert bare == []


def test_installing_adds_one_name_and_the_users_folders_never_shadow_it(tmp_path: Path) -> None:
    """The wheel holds `parashift/` (the rooms inside it) and its metadata, nothing else; from
    a working directory with `specs/`, `tasks/`, `storage/` ... folders of the user's own, the
    CLI and the workers import parashift's (workers: `launcher.launch.worker_env`)."""
    import shutil
    import subprocess
    import sys
    import zipfile

    from parashift.launcher.launch import worker_env

    source = tmp_path / "source"
    for name in [*PACKAGES, "bench"]:
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "wheel"), str(source)], check=True, capture_output=True)
    names = zipfile.ZipFile(next((tmp_path / "wheel").glob("*.whl"))).namelist()
    assert {name.split("/")[0] for name in names} == {"parashift", "parashift-0.1.0.dist-info"}
    for room in [*PACKAGES[:-1], "bench"]:  # every module of every room is in it
        assert {f"parashift/{p.relative_to(ROOT)}" for p in (ROOT / room).rglob("*.py")} <= set(names), room
    assert "parashift/specs/default.yaml" in names

    user = tmp_path / "user"
    for name in [*PACKAGES[:-1], "bench"]:
        (user / name).mkdir(parents=True)
        (user / name / "__init__.py").write_text("raise ImportError('the user folder was imported')\n")
    code = "import parashift.specs, parashift.trainer.worker, parashift.tasks.plan; print(parashift.specs.__file__)"
    for env in (worker_env("cpu"), None):
        out = subprocess.run([sys.executable, "-c", code], cwd=user, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == str(ROOT / "specs" / "__init__.py")
    cli = subprocess.run([str(Path(sys.executable).with_name("parashift")), "validate", str(ROOT / "specs/default.yaml")],
                         cwd=user, capture_output=True, text=True)
    assert cli.returncode == 0, cli.stdout + cli.stderr


def test_gpt_and_llama_workers_never_import_transformers() -> None:
    """Only the `hf` family's processes pay transformers' import (about 10 s of CPU here):
    a relaunch of a GPT or Llama job is dominated by interpreter start-up already."""
    import subprocess
    import sys

    code = ("import sys, parashift.trainer.worker, parashift.trainer.layout, parashift.models.gpt.family, "
            "parashift.models.llama.family, parashift.models.llama.hf; "
            "print([m for m in sys.modules if m.split('.')[0] in ('transformers', 'safetensors')])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def imported_on_load(source: str, known: Collection[str]) -> set[str]:
    """What a module imports when it is loaded: its body and class bodies, not functions (they
    import when called), `if TYPE_CHECKING:` nor `if __name__ == "__main__":` blocks."""
    out: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if isinstance(node, ast.If) and ("TYPE_CHECKING" in ast.unparse(node.test) or "__main__" in ast.unparse(node.test)):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import | ast.ImportFrom):
                out.update(imports_in(ast.Module(body=[node], type_ignores=[]), known))
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []))

    visit(ast.parse(source).body)
    return out


def loaded_with(start: str, sources: dict[str, str]) -> set[str]:
    """Every module that loading `start` loads, its packages' `__init__`s included (others'
    modules by their own names: `torch`, `torch.distributed`)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        parts = todo.pop().split(".")
        for i in range(1, len(parts) + 1):  # a package's __init__ runs before its submodule
            name = ".".join(parts[:i])
            if name not in seen:
                seen.add(name)
                todo.extend(imported_on_load(sources[name], sources) if name in sources else ())
    return seen


def test_flows_and_the_launcher_load_no_torch() -> None:
    """Workers import torch; a flow's process only where a task needs it (planning, resharding).
    Loading a flow (`prefect deploy` reads each one, a flow run starts with it) or any module of
    the launcher room loads no torch: a node's flow run, which only starts and supervises its
    workers, never pays for it (1.6-2 s of CPU per node run on this machine)."""
    sources = {name: path.read_text() for name, path in modules().items()}
    starts = sorted(name for name in sources if name.split(".")[0] in ("flows", "launcher"))
    found = {start: sorted(m for m in loaded_with(start, sources) if m.split(".")[0] == "torch") for start in starts}
    assert {start: torch for start, torch in found.items() if torch} == {}


def test_a_torch_import_on_load_is_seen() -> None:
    sources = {"a": "import b\ndef f():\n    import numpy\n",
               "b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pandas\n"
                    "try:\n    import torch.distributed\nexcept ImportError:\n    pass\n"
                    "if __name__ == '__main__':\n    import scipy\n"}
    loaded = loaded_with("a", sources)
    assert "torch" in loaded and "torch.distributed" in loaded and not {"numpy", "pandas", "scipy"} & loaded


def test_the_flow_counts_and_places_parameters_without_torchs_compiler() -> None:
    """The flow's process builds GPT and Llama models on the meta device (parameters counted,
    the state's layout): meta's random fills would import torch._dynamo (0.9 s of CPU per
    `parashift run`), so the build skips them, and gives the shapes a filled build gives."""
    import subprocess
    import sys

    code = ("import sys, torch; from parashift.specs import load_spec; from parashift.specs.plan import Plan; "
            "from parashift.tasks.profile import exact_parameter_count; "
            "from parashift.trainer.layout import parameter_placements; from parashift.models import family_of; "
            "s = load_spec('specs/default.yaml'); n, _ = exact_parameter_count(s); "
            "places = parameter_placements(Plan.fully_sharded(2), s.model); "
            "assert 'torch._dynamo' not in sys.modules, 'imported'; "
            "m = family_of(s.model).build(s.model); "
            "assert n == sum(p.numel() for p in m.parameters()); "
            "assert {k: tuple(p.shape) for k, p in m.named_parameters()} == {k: p.shape for k, p in places.items()}; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stdout + out.stderr


STORES = ("ObjectStore", "CheckpointStore")


def stores_opened_by_hand(source: str) -> list[int]:
    """Lines that build an ObjectStore or CheckpointStore from a storage section's fields
    (`x.storage.url`, `x.storage_options`) instead of `storage.open_store` / `job_store`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if name not in STORES:
            continue
        fields = [n for arg in [*node.args, *(k.value for k in node.keywords)] for n in ast.walk(arg)
                  if isinstance(n, ast.Attribute)]
        if any(f.attr == "storage_options" or (f.attr == "url" and getattr(f.value, "attr", None) == "storage")
               for f in fields):
            lines.append(node.lineno)
    return lines


def test_a_jobs_storage_is_opened_one_way() -> None:
    """Outside storage/, a job's store comes from `storage.open_store(spec.storage)` or
    `storage.job_store(spec)`, never from its URL and options spelled out again."""
    found = {}
    for folder in (*PACKAGES, "bench", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            if folder != "storage":
                lines = stores_opened_by_hand(path.read_text())
                if lines:
                    found[str(path.relative_to(ROOT))] = lines
    assert found == {}


def test_a_store_opened_by_hand_is_seen() -> None:
    assert stores_opened_by_hand(
        "s = ObjectStore(spec.storage.url, dict(spec.storage.storage_options))\n"
        "c = storage.CheckpointStore(ObjectStore(self.spec.storage.url), spec.job_id)\n"
        "t = ObjectStore(tier_url)\n") == [1, 2, 2]


# What starting or supervising processes takes: only `launcher` (and the CLI's server commands,
# the tests and benchmarks) may use them. A rank handling the signals sent to it (a stop) is
# the rank's own business.
PROCESS_SUPERVISION = ("subprocess", "multiprocessing")


def test_the_trainer_starts_and_supervises_no_processes() -> None:
    bad = {(name, m) for name, deps in graph().items() if name.split(".")[0] == "trainer" for m in deps
           if m.split(".")[0] in PROCESS_SUPERVISION}
    assert bad == set()


def test_the_trainer_never_imports_the_launcher() -> None:
    """The launcher starts `trainer.worker` by module name; the trainer knows nothing of it."""
    bad = {(name, m) for name, deps in graph().items() if name.split(".")[0] == "trainer" for m in deps
           if m.split(".")[0] == "launcher"}
    assert bad == set()


# The rooms between orchestration and training, where a newcomer reads most: no function longer
# than a screen or two (a long one is split into named steps: `trainer.trainer.Trainer`).
READABLE_ROOMS = ("trainer", "launcher", "tasks", "flows")
MAX_FUNCTION_LINES = 80


def long_functions(rooms: tuple[str, ...] = READABLE_ROOMS, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    found = []
    for room in rooms:
        for path in sorted((ROOT / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                    if lines > limit:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_of_the_middle_rooms_exceeds_80_lines() -> None:
    assert long_functions() == []


def test_a_long_function_is_seen() -> None:
    assert long_functions(("trainer",), limit=10)


def environment_names(paths: list[Path]) -> list[str]:
    """`PARASHIFT_*` variables spelled out in code (docstrings aside): `file:line NAME`."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text())
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                    and node.value.startswith("PARASHIFT_"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
    return found


def test_every_environment_variable_is_named_in_one_module() -> None:
    """A job's settings come from its spec or Plan; the few environment variables left (what a
    launcher tells the processes it starts, a machine's own settings) are named, with why, in
    `specs/environ.py` alone."""
    paths = [p for package in (*PACKAGES, "bench") for p in sorted((ROOT / package).rglob("*.py"))
             if p != ROOT / "specs" / "environ.py"]
    assert environment_names(paths) == []
    assert environment_names([ROOT / "specs" / "environ.py"])  # the check sees one

