"""Static checks of deploy/: every YAML parses and has what its kind needs, the pins agree, and
every ``pagedserve ...`` command line in the README, the YAMLs and the scripts parses with the
real CLI parser (so the docs cannot drift from the options the code defines).
"""

from __future__ import annotations

import copy
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import pagedserve

DEPLOY = Path(pagedserve.__file__).resolve().parent / "deploy"
YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
COMMAND = re.compile(r"(?<![\w/.:-])pagedserve\s+(generate|serve)(?=\s|$|`)")
SUBCOMMANDS_PARSED: dict[str, int] = {}


def _docs(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    assert docs, f"{path} is empty"
    assert all(isinstance(d, dict) for d in docs), f"{path}: every document must be a mapping"
    return docs


def _rel(path: Path) -> str:
    return str(path.relative_to(DEPLOY))


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


def _dockerfile_pins() -> dict[str, str]:
    text = (DEPLOY / "docker" / "Dockerfile").read_text(encoding="utf-8")
    base = re.search(r"^FROM\s+(\S+)", text, re.M)
    ray = re.search(r"\bray(?:\[[\w,]+\])?==([\w.]+)", text)
    torch = re.search(r"\btorch==([\w.+]+)", text)
    assert base and ray and torch, "the Dockerfile must pin its base image, ray and torch"
    return {"base": base.group(1), "ray": ray.group(1), "torch": torch.group(1)}


# ------------------------------------------------------------------------------ per-kind checks
def _check_pod_template(where: str, template: dict[str, Any], *, gpu: bool) -> None:
    containers = template["spec"]["containers"]
    assert containers, f"{where}: no containers"
    ray_container = containers[0]
    assert ray_container.get("image"), f"{where}: the Ray container needs an image"
    res = ray_container.get("resources", {})
    assert res.get("requests") or res.get("limits"), f"{where}: set resources"
    if gpu:
        assert "nvidia.com/gpu" in res.get("limits", {}), f"{where}: GPU workers need a GPU limit"


def _check_ray_cluster_spec(where: str, spec: dict[str, Any]) -> None:
    assert spec.get("rayVersion") == _dockerfile_pins()["ray"], (
        f"{where}: rayVersion must equal the image's Ray ({_dockerfile_pins()['ray']})"
    )
    head = spec["headGroupSpec"]
    assert isinstance(head.get("rayStartParams"), dict), f"{where}: head rayStartParams"
    _check_pod_template(f"{where} head", head["template"], gpu=False)
    workers = spec["workerGroupSpecs"]
    assert workers, f"{where}: no worker groups"
    for group in workers:
        name = f"{where} worker group {group.get('groupName')}"
        assert group.get("groupName") and isinstance(group.get("replicas"), int), name
        assert isinstance(group.get("rayStartParams"), dict), f"{name}: rayStartParams"
        assert group.get("minReplicas", 0) <= group["replicas"] <= group.get("maxReplicas", 1e9)
        _check_pod_template(name, group["template"], gpu=True)


def _check_cluster_yaml(where: str, doc: dict[str, Any]) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    assert doc.get("cluster_name"), where
    provider = doc["provider"]
    assert provider.get("type"), f"{where}: provider.type"
    if provider["type"] == "local":
        assert provider.get("head_ip") and provider.get("worker_ips"), f"{where}: local hosts"
    else:
        types = doc["available_node_types"]
        assert doc["head_node_type"] in types, f"{where}: head_node_type must be a node type"
        for name, t in types.items():
            assert "node_config" in t and "max_workers" in t, f"{where}: node type {name}"
        assert any(t.get("max_workers", 0) > 0 for t in types.values()), f"{where}: no workers"
    for key in ("setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
        assert key in doc, f"{where}: {key}"
    assert any("ray start --head" in c for c in doc["head_start_ray_commands"]), where
    assert any("ray start --address" in c for c in doc["worker_start_ray_commands"]), where
    # Ray's own schema, after the launcher fills in its defaults (as `ray up` does).
    validate_config(prepare_config(copy.deepcopy(doc)))
    for cmd in _strings(doc):
        for pin in re.findall(r"\bray(?:\[[\w,]+\])?==([\w.]+)", cmd):
            assert pin == _dockerfile_pins()["ray"], f"{where}: ray=={pin} differs from the image"


def _check_runtime_env(where: str, doc: dict[str, Any]) -> None:
    from ray.runtime_env import RuntimeEnv

    known = {"working_dir", "py_modules", "pip", "uv", "conda", "env_vars", "excludes",
             "py_executable", "container", "image_uri", "config"}
    assert set(doc) <= known, f"{where}: unknown runtime_env keys {set(doc) - known}"
    assert all(isinstance(v, str) for v in doc.get("env_vars", {}).values()), (
        f"{where}: env_vars values must be strings"
    )
    RuntimeEnv(**doc)  # Ray's own validation


def _check_k8s(where: str, doc: dict[str, Any]) -> None:
    kind = doc["kind"]
    spec = doc.get("spec", {})
    if kind == "RayCluster":
        assert doc["apiVersion"] == "ray.io/v1", where
        _check_ray_cluster_spec(where, spec)
    elif kind == "RayJob":
        assert doc["apiVersion"] == "ray.io/v1", where
        assert spec.get("entrypoint"), f"{where}: entrypoint"
        assert "rayClusterSpec" in spec or "clusterSelector" in spec, where
        if "rayClusterSpec" in spec:
            _check_ray_cluster_spec(where, spec["rayClusterSpec"])
        if "runtimeEnvYAML" in spec:
            _check_runtime_env(where, yaml.safe_load(spec["runtimeEnvYAML"]))
    elif kind == "RayService":
        assert doc["apiVersion"] == "ray.io/v1", where
        serve = yaml.safe_load(spec["serveConfigV2"])
        assert serve.get("applications"), f"{where}: serveConfigV2 has no applications"
        _check_ray_cluster_spec(where, spec["rayClusterConfig"])
    elif kind == "Service":
        assert spec.get("ports") and spec.get("selector"), where
    elif kind == "Job":
        assert spec["template"]["spec"]["containers"], where
    elif kind in ("Secret", "PersistentVolumeClaim"):
        assert doc.get("metadata", {}).get("name"), where
    else:
        pytest.fail(f"{where}: no check for kind {kind}")


def test_there_is_something_to_check() -> None:
    names = {_rel(p) for p in YAML_FILES}
    for expected in ("ray/cluster-aws.yaml", "ray/cluster-onprem.yaml", "jobs/runtime_env.yaml",
                     "k8s/raycluster.yaml", "k8s/rayjob-generate.yaml", "k8s/server.yaml"):
        assert expected in names
    assert (DEPLOY / "README.md").is_file() and (DEPLOY / "docker" / "Dockerfile").is_file()


@pytest.mark.parametrize("path", YAML_FILES, ids=_rel)
def test_yaml_has_the_keys_its_kind_needs(path: Path) -> None:
    for i, doc in enumerate(_docs(path)):
        where = f"{_rel(path)}[{i}]"
        if "cluster_name" in doc:
            _check_cluster_yaml(where, doc)
        elif "kind" in doc and "apiVersion" in doc:
            _check_k8s(where, doc)
        elif path.name.startswith("runtime_env"):
            _check_runtime_env(where, doc)
        elif path.parent.name == "prometheus":  # Prometheus rule files
            assert all(g["name"] and g["rules"] for g in doc["groups"]), where
            for rule in (r for g in doc["groups"] for r in g["rules"]):
                assert ("record" in rule or "alert" in rule) and rule["expr"], where
        else:
            pytest.fail(f"{where}: not a cluster YAML, a Kubernetes object, a runtime_env or "
                        "Prometheus rules")


def test_provider_kinds() -> None:
    providers = {_docs(p)[0]["provider"]["type"] for p in (DEPLOY / "ray").glob("*.yaml")}
    assert "local" in providers and providers - {"local"}, "one cloud and one on-prem cluster"


def test_server_manifest_runs_the_server_and_exposes_it() -> None:
    docs = _docs(DEPLOY / "k8s" / "server.yaml")
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    service = next(d for d in docs if d["kind"] == "Service")
    # KubeRay keeps our container command only with this annotation.
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    script = " ".join(head["command"] + head["args"])
    assert "$KUBERAY_GEN_RAY_START_CMD" in script and "pagedserve serve" in script
    assert "--port 8000" in script and "--address auto" in script
    assert "readinessProbe" not in head  # a not-ready head drops out of the head Service
    assert service["spec"]["selector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    assert service["spec"]["selector"]["ray.io/node-type"] == "head"
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [8000]


def test_dockerfile_pins_python_ray_and_torch() -> None:
    pins = _dockerfile_pins()
    assert re.fullmatch(r"python:3\.11[\w.-]*", pins["base"]), pins["base"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", pins["ray"]) and re.fullmatch(r"\d+\.\d+\.\d+", pins[
        "torch"])
    text = (DEPLOY / "docker" / "Dockerfile").read_text(encoding="utf-8")
    assert "ray[default]==" in text, "the job server needs ray[default]"
    assert (DEPLOY / "docker" / "Dockerfile.dockerignore").read_text().count(".venv")


@pytest.mark.parametrize("script", sorted(DEPLOY.rglob("*.sh")), ids=_rel)
def test_shell_scripts_parse(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_wait_script_compiles() -> None:
    script = DEPLOY / "scripts" / "wait_for_nodes.py"
    compile(script.read_text(encoding="utf-8"), str(script), "exec")  # no .pyc left behind


# ------------------------------------------------------------------------------ command lines
def _commands_in(text: str) -> Iterator[list[str]]:
    """Every ``pagedserve generate|serve ...`` in ``text``, as argv after ``pagedserve``."""
    text = re.sub(r"\\\n\s*", " ", text)  # shell line continuations
    for line in text.splitlines():
        for m in COMMAND.finditer(line):
            lex = shlex.shlex(line[m.start():], posix=True, punctuation_chars=";&|()`")
            lex.whitespace_split = True
            argv: list[str] = []
            for tok in lex:
                if tok and set(tok) <= set(";&|()`"):
                    break  # the end of this command in a shell line
                argv.append(tok)
            yield argv[1:]


def _command_sources() -> list[tuple[str, list[str]]]:
    found: list[tuple[str, list[str]]] = []
    readme = (DEPLOY / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```[a-z]*\n(.*?)```", readme, re.S)
    for block in blocks:
        found += [("README.md (code)", argv) for argv in _commands_in(block)]
    prose = re.sub(r"```.*?```", "", readme, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        found += [("README.md (inline)", argv) for argv in _commands_in(span)]
    for path in YAML_FILES:
        for doc in _docs(path):
            for s in _strings(doc):
                found += [(_rel(path), argv) for argv in _commands_in(s)]
    for path in sorted(DEPLOY.rglob("*.sh")):
        found += [(_rel(path), argv) for argv in _commands_in(path.read_text(encoding="utf-8"))]
    return found


def test_command_lines_are_found() -> None:
    sources = _command_sources()
    subcommands = [argv[0] for _, argv in sources]
    assert subcommands.count("generate") >= 8 and subcommands.count("serve") >= 4, subcommands
    where = {w.split(" ")[0] for w, _ in sources}
    assert {"README.md", "k8s/rayjob-generate.yaml", "k8s/server.yaml", "jobs/submit.sh"} <= where


@pytest.mark.parametrize(
    ("where", "argv"), _command_sources(), ids=lambda v: v if isinstance(v, str) else " ".join(v)
)
def test_command_line_parses_with_the_cli(where: str, argv: list[str]) -> None:
    from pagedserve.cli import build_parser

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `pagedserve {' '.join(argv)}` does not parse with "
                    "pagedserve.cli.build_parser() (see the error above)")
    assert args.command == argv[0]
