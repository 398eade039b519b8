"""deploy/compose.yaml and deploy/otel-collector.yaml, validated offline (no Docker engine).

- The compose file against the Compose Specification's JSON Schema (vendored in
  tests/data/compose-spec.json from check-jsonschema's copy, Apache-2.0), then what the
  schema cannot know: every dependency and mounted file exists, every ``hookbus`` command
  line parses with the real CLI, every worker target loads a `HookWorker`, every process
  exports OTLP to the collector's HTTP receiver, NATS is started with deploy/nats/hookbus.conf.
- The collector config structurally: every component a pipeline names is configured, every
  configured one is used, the trace pipeline reaches Jaeger, the metrics one an exporter.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import jsonschema
import pytest
import yaml

from hookbus.cli._common import load_object
from hookbus.cli._main import cli
from hookbus.workers import HookWorker

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE_SCHEMA = json.loads((Path(__file__).parent / "data" / "compose-spec.json").read_text())
COLLECTOR_KINDS = ("receivers", "processors", "exporters", "connectors", "extensions")
KNOWN_COMPONENTS = {
    "receivers": {"otlp"},
    "processors": {"batch", "memory_limiter"},
    "exporters": {"otlp", "otlphttp", "debug", "prometheus"},
    "extensions": {"health_check"},
}
"""Component types this config may use (all in otel/opentelemetry-collector-contrib)."""


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def collector() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())


def schema_errors(doc: dict[str, Any]) -> list[str]:
    validator_cls = jsonschema.validators.validator_for(COMPOSE_SCHEMA)
    validator_cls.check_schema(COMPOSE_SCHEMA)
    validator = validator_cls(COMPOSE_SCHEMA)
    errors = validator.iter_errors(doc)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


def hookbus_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose["services"].items() if s.get("image") == "hookbus:local"}


def test_compose_file_matches_the_compose_spec(compose: dict[str, Any]) -> None:
    assert schema_errors(compose) == []


@pytest.mark.parametrize(
    "break_it",
    [
        lambda d: d["services"]["nats"].update(ports="4222"),  # must be a list
        lambda d: d["services"]["dispatcher"].update(restart_policy="always"),  # unknown key
        lambda d: d["services"]["dispatcher"].update(depends_on=5),
    ],
    ids=["ports-not-a-list", "unknown-key", "depends-on-not-a-list-or-map"],
)
def test_the_schema_check_refuses_a_broken_compose_file(
    compose: dict[str, Any], break_it: Any
) -> None:
    broken = copy.deepcopy(compose)
    break_it(broken)
    assert schema_errors(broken) != []


def test_compose_has_the_whole_stack(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"nats", "dispatcher", "otel-collector", "jaeger"} <= set(services)
    workers = [n for n, s in hookbus_services(compose).items() if "worker" in s["command"]]
    assert len(workers) >= 2
    for name, service in services.items():
        for dep in service.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
    nats = services["nats"]
    assert nats["command"] == ["-c", "/etc/nats/hookbus.conf"]
    assert "./nats/hookbus.conf:/etc/nats/hookbus.conf:ro" in nats["volumes"]
    assert "healthcheck" in nats


def test_mounted_files_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).is_file(), f"{name} mounts missing {source}"
        build = service.get("build")
        if build:
            context = DEPLOY / build["context"]
            dockerfile = (context / build["dockerfile"]).read_text()
            for line in dockerfile.splitlines():  # what the image copies exists here
                if line.startswith("COPY "):
                    for source in line.split()[1:-1]:
                        assert (context / source).exists(), f"Dockerfile copies missing {source}"


def test_every_hookbus_command_line_parses(compose: dict[str, Any]) -> None:
    """Each service's command is given to the real click CLI's parser (nothing runs)."""
    for name, service in hookbus_services(compose).items():
        # /app in the image is the repository's layout (deploy/Dockerfile copies it so)
        args = [str(ROOT / a.removeprefix("/app/")) if a.startswith("/app/") else a
                for a in service["command"]]  # fmt: skip
        i = next(i for i, arg in enumerate(args) if arg in cli.commands)
        sub_name, sub = args[i], cli.commands[args[i]]
        # the global options (resilient: an empty list would print the help and exit)
        with cli.make_context("hookbus", args[:i], resilient_parsing=i == 0) as ctx:
            with sub.make_context(sub_name, args[i + 1 :], parent=ctx) as sub_ctx:
                assert isinstance(sub_ctx, click.Context)
                if sub_name == "worker":
                    assert isinstance(load_object(sub_ctx.params["target"]), HookWorker), name


def test_every_hookbus_process_reaches_nats_and_the_collector(
    compose: dict[str, Any], collector: dict[str, Any]
) -> None:
    http = urlsplit("http://" + collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"])
    for name, service in hookbus_services(compose).items():
        env = service["environment"]
        assert urlsplit(env["NATS_URL"]).hostname == "nats", name
        endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert endpoint.hostname == "otel-collector" and endpoint.port == http.port, name
        assert env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf") == "http/protobuf"
        assert env["OTEL_SERVICE_NAME"].startswith("hookbus-")
    volumes = compose["services"]["otel-collector"]["volumes"]
    config = "./otel-collector.yaml:/etc/otelcol/config.yaml:ro"
    assert config in volumes
    assert "--config=/etc/otelcol/config.yaml" in compose["services"]["otel-collector"]["command"]


def test_collector_pipelines_use_only_configured_components(collector: dict[str, Any]) -> None:
    service = collector["service"]
    used: dict[str, set[str]] = {kind: set() for kind in COLLECTOR_KINDS}
    for pipeline_name, pipeline in service["pipelines"].items():
        assert pipeline_name.split("/")[0] in ("traces", "metrics", "logs")
        assert pipeline.get("receivers") and pipeline.get("exporters"), pipeline_name
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                configured = collector.get(kind) or {}
                assert component in configured, f"{pipeline_name}: no {kind} {component}"
                used[kind].add(component)
    for extension in service.get("extensions", []):
        assert extension in (collector.get("extensions") or {})
        used["extensions"].add(extension)
    for kind, known in KNOWN_COMPONENTS.items():
        configured = set(collector.get(kind) or {})
        assert configured == used[kind], f"{kind} configured but unused: {configured - used[kind]}"
        assert {c.split("/")[0] for c in configured} <= known


def test_collector_sends_traces_to_jaeger_and_exposes_metrics(
    compose: dict[str, Any], collector: dict[str, Any]
) -> None:
    traces = collector["service"]["pipelines"]["traces"]
    jaeger = [e for e in traces["exporters"] if e.split("/")[0] in ("otlp", "otlphttp")]
    assert jaeger
    target = urlsplit("//" + collector["exporters"][jaeger[0]]["endpoint"])
    assert target.hostname in compose["services"] and target.hostname == "jaeger"
    metrics = collector["service"]["pipelines"]["metrics"]
    assert "prometheus" in metrics["exporters"]
    port = urlsplit("//" + collector["exporters"]["prometheus"]["endpoint"]).port
    assert f"{port}:{port}" in compose["services"]["otel-collector"]["ports"]


def test_a_broken_collector_config_is_refused(collector: dict[str, Any]) -> None:
    broken = copy.deepcopy(collector)
    broken["service"]["pipelines"]["traces"]["exporters"].append("zipkin")
    with pytest.raises(AssertionError, match="no exporters zipkin"):
        test_collector_pipelines_use_only_configured_components(broken)
