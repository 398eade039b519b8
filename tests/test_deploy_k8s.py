"""deploy/k8s/*.yaml validated offline (no cluster, no Docker engine).

- Every object against the Kubernetes JSON schemas of the oldest and the newest release
  kubernetes-validate bundles, strictly (an unknown field is an error), and a YAML mapping
  with a key twice (which PyYAML and the schemas would let pass: the last one wins) is
  refused. Broken copies are refused, so the check is real.
- ``kubectl apply --dry-run=client`` over the folder, as documented: kubectl's own parsing
  and apply logic, against a stub API server on loopback that answers discovery for the
  Kubernetes resources used here and "not found" for every object (a client dry run still
  asks the server what exists). Schema validation there is off (``--validate=false``): it
  would need the server's OpenAPI documents; the schemas above do that part.
- Every hookbus command line parses with the real CLI under its container's environment,
  subcommands of groups (``auth provision``) included.
- The security of docs/security.md: the `hookbus auth init` and ``kubectl create``
  commands of the header (run here) write every seed, the CA and the certificate the
  manifests mount; each pod gets its own identity of the right role (the provisioning Job
  the admin, alone) and the CA, from Secrets and a ConfigMap; no seed is in a ConfigMap
  or a manifest. The server's certificate verifies (a TLS handshake in memory) for every
  name a pod connects to and the service's names, and for no other name. A pod's
  configuration alone (its seed, the CA, NATS_URL) provisions the buckets of a
  nats-server run over TLS with the generated config.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shlex
import shutil
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import yaml
from _debian import apt_install
from click.testing import CliRunner

from hookbus.cli import EmbeddedNatsServer
from hookbus.cli._auth_files import load_setup
from hookbus.cli._command_support import load_object
from hookbus.cli._command_tree import cli
from hookbus.workers import HookWorker

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
IMAGE = "hookbus:local"
HOOKBUS = [sys.executable, "-m", "hookbus.cli"]
NAMESPACE = "hookbus"
SERVICE_NAMES = ("nats", f"nats.{NAMESPACE}.svc", f"nats.{NAMESPACE}.svc.cluster.local")
"""The names of the NATS service clients may use: the certificate must be for each."""
GENERATED = "auth/"
"""Where the header's commands write and read `hookbus auth init`'s files."""


# -- reading the manifests ----------------------------------------------------------------
class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that holds a key twice (kubectl does)."""


def _mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _value in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_manifest(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.load_all(text, Loader=_UniqueKeyLoader) if doc]


@functools.cache
def _objects() -> tuple[tuple[str, dict[str, Any]], ...]:
    return tuple((p.name, doc) for p in MANIFESTS for doc in load_manifest(p.read_text()))


def objects() -> list[tuple[str, dict[str, Any]]]:
    """(file name, object) of every object in deploy/k8s/, a fresh copy each call."""
    return copy.deepcopy(list(_objects()))


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The pod template's spec of a workload (Deployment, Job, ...), else None."""
    return obj.get("spec", {}).get("template", {}).get("spec")


def hookbus_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(object name, pod spec, container) of every container running the hookbus image,
    init containers included."""
    out = []
    for _file, obj in objects():
        pod = pod_spec(obj)
        for container in [
            *(pod or {}).get("initContainers", []),
            *(pod or {}).get("containers", []),
        ]:
            if container["image"] == IMAGE:
                out.append((obj["metadata"]["name"], pod, container))
    return out


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """A container's environment (plain values only: credentials are files, never env)."""
    env = {}
    for var in container.get("env", []):
        assert set(var) == {"name", "value"}, f"{container['name']}: {var}"
        env[var["name"]] = var["value"]
    return env


def documented_commands(path: Path) -> list[list[str]]:
    """The ``hookbus ...`` and ``kubectl ...`` commands in a manifest's header comments,
    continuation lines (a trailing backslash) joined."""
    commands: list[list[str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if pending:
            text = f"{pending} {text}"
        if text.endswith("\\"):
            pending = text[:-1].strip()
            continue
        pending = ""
        if text.startswith(("hookbus ", "kubectl ")):
            commands.append(shlex.split(text))
    return commands


def command_line(args: list[str]) -> tuple[list[str], click.Context]:
    """A hookbus command line given to the real click parser (nothing runs): the path of
    its (sub)command, e.g. ``["auth", "provision"]``, and the innermost context. Groups
    are descended into, so a subcommand's own options are checked too. Paths under
    ``/app/`` (the image's copy of the repository, deploy/Dockerfile) are the checkout's."""
    args = [str(ROOT / a.removeprefix("/app/")) if a.startswith("/app/") else a for a in args]
    i = next(i for i, arg in enumerate(args) if arg in cli.commands)
    # the global options (resilient: an empty list would print the help and exit)
    ctx = cli.make_context("hookbus", args[:i], resilient_parsing=i == 0)
    group: click.Group = cli
    rest, path = args[i:], []
    while True:
        name, command = rest[0], group.commands[rest[0]]
        path.append(name)
        if not isinstance(command, click.Group):
            return path, command.make_context(name, rest[1:], parent=ctx)
        j = next(j for j, arg in enumerate(rest[1:], 1) if arg in command.commands)
        ctx = command.make_context(name, rest[1:j], parent=ctx, resilient_parsing=j == 1)
        group, rest = command, rest[j:]


# -- the Kubernetes schemas ---------------------------------------------------------------
def _kubernetes_versions() -> list[str]:
    from kubernetes_validate.utils import all_versions, major_minor

    bundled = sorted(
        {major_minor(v) for v in all_versions()}, key=lambda v: [*map(int, v.split("."))]
    )
    return [bundled[0], bundled[-1]]


def schema_errors(obj: dict[str, Any], version: str) -> list[str]:
    """What the Kubernetes `version` JSON schema of `obj`'s kind says against it, strictly
    (unknown fields refused); a kind it has no schema for is an error too."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(map(str, exc.path))}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [exc.message]
    return []


def test_there_are_manifests() -> None:
    kinds = {(obj["kind"], obj["metadata"]["name"]) for _file, obj in objects()}
    assert {("Deployment", "hookbus-dispatcher"), ("Job", "hookbus-provision")} <= kinds
    assert any(kind == "Deployment" and "worker" in name for kind, name in kinds)


@pytest.mark.parametrize("version", _kubernetes_versions())
def test_every_object_matches_the_kubernetes_schemas(version: str) -> None:
    for file, obj in objects():
        assert schema_errors(obj, version) == [], f"{file}: {obj['kind']} {obj['metadata']}"


def _dispatcher(objs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    return next(obj for _f, obj in objs if obj["metadata"]["name"] == "hookbus-dispatcher")


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]["containers"][0]


BREAKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "unknown-field": lambda d: d["spec"].update(replica=2),
    "args-not-a-list": lambda d: _container(d).update(args="--log-level info dispatcher"),
    "env-value-not-a-string": lambda d: _container(d)["env"].append({"name": "N", "value": 3}),
    "no-containers": lambda d: d["spec"]["template"]["spec"].pop("containers"),
    "misspelled-kind": lambda d: d.update(kind="Deploymnet"),
    "volume-source-unknown": lambda d: d["spec"]["template"]["spec"]["volumes"][0]["projected"][
        "sources"
    ].append({"secrets": {"name": "x"}}),
}


@pytest.mark.parametrize("break_it", BREAKS.values(), ids=BREAKS.keys())
def test_the_schema_check_refuses_a_broken_manifest(break_it: Any) -> None:
    from kubernetes_validate.utils import latest_version

    broken = _dispatcher(objects())
    break_it(broken)
    assert schema_errors(broken, latest_version()) != []


def test_every_name_is_a_dns_label() -> None:
    """What neither the schemas nor a client dry run check (the API server does): object,
    container and volume names are DNS-1123 labels."""
    for file, obj in objects():
        names = [obj["metadata"]["name"]]
        pod = pod_spec(obj) or {}
        names += [c["name"] for c in [*pod.get("initContainers", []), *pod.get("containers", [])]]
        names += [v["name"] for v in pod.get("volumes", [])]
        for name in names:
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name), (file, name)


def test_a_key_given_twice_is_refused() -> None:
    text = (K8S / "hookbus.yaml").read_text()
    twice = text.replace("  replicas: 2\n", "  replicas: 2\n  replicas: 3\n", 1)
    assert twice != text
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key 'replicas'"):
        load_manifest(twice)


# -- kubectl's client-side dry run --------------------------------------------------------
RESOURCES = {
    "v1": {"ConfigMap": "configmaps", "Secret": "secrets", "Service": "services",
           "ServiceAccount": "serviceaccounts", "Pod": "pods"},
    "apps/v1": {"Deployment": "deployments", "StatefulSet": "statefulsets",
                "DaemonSet": "daemonsets"},
    "batch/v1": {"Job": "jobs", "CronJob": "cronjobs"},
}  # fmt: skip
"""Namespaced resources of real Kubernetes (group/version -> kind -> resource) the stub
API server lists in its discovery documents: a kind not here is unknown to kubectl."""


class _StubApi(BaseHTTPRequestHandler):
    """Discovery of `RESOURCES` (the legacy documents: kubectl falls back to them from
    aggregated discovery) and 404 for every object, so kubectl's apply creates it."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        groups = [gv for gv in RESOURCES if "/" in gv]
        if path == "/version":
            return self._send(200, {"major": "1", "minor": "32", "gitVersion": "v1.32.0-stub"})
        if path == "/api":
            return self._send(200, {"kind": "APIVersions", "versions": ["v1"]})
        if path == "/apis":
            listed = [
                {"name": gv.split("/")[0], "versions": [{"groupVersion": gv, "version": "v1"}],
                 "preferredVersion": {"groupVersion": gv, "version": "v1"}}
                for gv in groups
            ]  # fmt: skip
            return self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": listed})
        for gv, kinds in RESOURCES.items():
            if path == ("/api/v1" if gv == "v1" else f"/apis/{gv}"):
                resources = [
                    {"name": plural, "singularName": kind.lower(), "namespaced": True,
                     "kind": kind, "verbs": ["create", "delete", "get", "list", "patch",
                                             "update", "watch"]}
                    for kind, plural in kinds.items()
                ]  # fmt: skip
                return self._send(
                    200,
                    {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
                     "resources": resources},
                )  # fmt: skip
        self._send(
            404,
            {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
             "code": 404, "message": f"{path} not found"},
        )  # fmt: skip


@pytest.fixture(scope="module")
def kubectl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Any]]:
    """``kubectl(*args)``: kubectl against the stub API server (a kubeconfig of its own,
    no cache or config of the user's touched)."""
    binary = apt_install("kubernetes-client", binary="kubectl")  # never a skip
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    home = tmp_path_factory.mktemp("kube")
    config = home / "kubeconfig"
    config.write_text(
        json.dumps(
            {"apiVersion": "v1", "kind": "Config", "current-context": "stub",
             "clusters": [{"name": "stub", "cluster": {
                 "server": f"http://127.0.0.1:{server.server_address[1]}"}}],
             "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}],
             "users": [{"name": "stub", "user": {}}]}
        )
    )  # fmt: skip
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "KUBECONFIG": str(config)}  # fmt: skip

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [binary, "--cache-dir", str(home / "cache"), "--request-timeout", "20s", *args],
            capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    yield run
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def _dry_run(kubectl: Any, folder: Path) -> subprocess.CompletedProcess[str]:
    return kubectl("apply", "-n", NAMESPACE, "--dry-run=client", "--validate=false",
                   "-f", str(folder))  # fmt: skip


def test_kubectl_dry_run_applies_every_object(kubectl: Any) -> None:
    done = _dry_run(kubectl, K8S)
    assert done.returncode == 0, done.stderr
    expected = set()
    for _file, obj in objects():
        group = obj["apiVersion"].rpartition("/")[0]
        kind = obj["kind"].lower() + (f".{group}" if group else "")
        expected.add(f"{kind}/{obj['metadata']['name']} created (dry run)")
    assert set(done.stdout.splitlines()) == expected, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("break_it", "said"),
    [
        (lambda t: t.replace("kind: Job", "kind: Jobb"), 'no matches for kind "Jobb"'),
        (lambda t: t.replace("apiVersion: batch/v1", "apiVersion: batch/v9"), "batch/v9"),
        (lambda t: t.replace("  backoffLimit:", " backoffLimit:"), "yaml"),
    ],
    ids=["unknown-kind", "unknown-version", "bad-indent"],
)
def test_kubectl_refuses_a_broken_manifest(
    kubectl: Any, tmp_path: Path, break_it: Any, said: str
) -> None:
    folder = tmp_path / "k8s"
    shutil.copytree(K8S, folder)
    text = (folder / "provision.yaml").read_text()
    (folder / "provision.yaml").write_text(broken := break_it(text))
    assert broken != text
    done = _dry_run(kubectl, folder)
    assert done.returncode != 0, done.stdout
    assert said in done.stderr, done.stderr


# -- the hookbus command lines ------------------------------------------------------------
@pytest.mark.parametrize("where", hookbus_containers(), ids=lambda w: f"{w[0]}/{w[2]['name']}")
def test_every_hookbus_command_line_parses(
    where: tuple[str, dict[str, Any], dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each container's args are given to the real click parser under its environment
    (NATS_URL, NATS_NKEY, HOOKBUS_*: what the options read); a worker's target loads."""
    name, _pod, container = where
    for var in [v for v in os.environ if v.startswith(("NATS_", "HOOKBUS_", "OTEL_"))]:
        monkeypatch.delenv(var)
    for var, value in container_env(container).items():
        monkeypatch.setenv(var, value)
    path, ctx = command_line(container["args"])
    if path == ["worker"]:
        assert isinstance(load_object(ctx.params["target"]), HookWorker), name
    if path != ["auth", "provision"]:
        assert ctx.params["bucket_replicas"] == 3 and ctx.params["strict_buckets"], name


def test_a_typo_in_a_subcommands_options_is_refused() -> None:
    with pytest.raises(click.NoSuchOption):
        command_line(["--log-level", "info", "auth", "provision", "--replica", "3"])


# -- credentials and TLS ------------------------------------------------------------------
@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the header's `hookbus auth init` writes, in a temporary folder."""
    commands = documented_commands(K8S / "hookbus.yaml")
    (args,) = [c[1:] for c in commands if c[:3] == ["hookbus", "auth", "init"]]
    out = args.index("--out") + 1
    assert args[out] == GENERATED.rstrip("/")
    args[out] = str(tmp_path_factory.mktemp("k8s") / "auth")
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return Path(args[out])


def created_objects(generated: Path) -> dict[tuple[str, str], dict[str, Path]]:
    """(kind, name) -> {key: file} of every Secret and ConfigMap the header's ``kubectl
    create`` commands make, from `generated` (each file checked to exist)."""
    made: dict[tuple[str, str], dict[str, Path]] = {}
    for command in documented_commands(K8S / "hookbus.yaml"):
        if command[0] != "kubectl" or "create" not in command:
            continue
        rest = command[command.index("create") + 1 :]
        if rest[0] == "namespace":
            continue
        kind = "ConfigMap" if rest[0] == "configmap" else "Secret"
        kind_args = rest[2:] if kind == "Secret" else rest[1:]  # secret generic|tls NAME
        name, options = kind_args[0], kind_args[1:]
        keys: dict[str, Path] = {}
        for option in options:
            flag, _, value = option.partition("=")
            assert value.startswith(GENERATED), option
            source = generated / value.removeprefix(GENERATED)
            assert source.is_file(), f"{name}: {value} is not written by `hookbus auth init`"
            key = {"--cert": "tls.crt", "--key": "tls.key", "--from-file": source.name}[flag]
            keys[key] = source
        made[(kind, name)] = keys
    return made


def mounted_file(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str, str]:
    """(kind, name, key) of the Secret or ConfigMap item that `path` in `container` is."""
    folder, _, file = path.rpartition("/")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
    assert mount.get("readOnly") is True, mount
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    sources = volume["projected"]["sources"] if "projected" in volume else [volume]
    found = []
    for source in sources:
        for kind, field, name_field in (("Secret", "secret", "name"),
                                         ("Secret", "secret", "secretName"),
                                         ("ConfigMap", "configMap", "name")):  # fmt: skip
            if field in source and name_field in source[field]:
                found += [
                    (kind, source[field][name_field], item["key"])
                    for item in source[field].get("items", [])
                    if item["path"] == file
                ]
    assert len(found) == 1, f"{path}: {found}"
    return found[0]


def test_every_pod_connects_as_its_own_identity_and_verifies_the_server(generated: Path) -> None:
    """NATS_NKEY is a seed from a Secret (of the role the command needs), NATS_CA the CA
    from `hookbus auth init`; only the provisioning Job has the admin's seed."""
    setup = load_setup(generated)
    made = created_objects(generated)
    for kind, name in made:
        for key, source in made[(kind, name)].items():
            if kind == "ConfigMap":  # no secret in a ConfigMap
                assert not source.name.endswith((".nk", "key.pem", ".conf")), (name, key)
    admins = []
    for name, pod, container in hookbus_containers():
        env = container_env(container)
        assert not any(v.startswith("SU") for v in env.values()), f"{name}: a seed in env"
        seed_obj = mounted_file(pod, container, env["NATS_NKEY"])
        ca_obj = mounted_file(pod, container, env["NATS_CA"])
        assert seed_obj[0] == "Secret", name
        seed = made[seed_obj[:2]][seed_obj[2]]
        assert made[ca_obj[:2]][ca_obj[2]] == generated / "ca.pem", name
        who = next(i for i in setup.identities if i.seed_path(generated) == seed)
        path, ctx = command_line(container["args"])
        if path == ["auth", "provision"]:
            assert who.role == "admin", name
            admins.append(name)
        elif path == ["worker"]:
            assert who.role == "worker", name
            obj = load_object(ctx.params["target"])
            served = {f"{s.declaration.event}/{s.declaration.name}" for s in obj.handlers}
            assert served <= set(who.handlers), f"{name}: {served - set(who.handlers)}"
        else:
            assert who.role == "dispatcher", name
    assert admins == ["hookbus-provision"]
    # the admin's seed has a Secret of its own (deleted once provisioned, as documented)
    (admin_secret,) = [k for k, keys in made.items() if "admin-admin.nk" in keys]
    assert list(made[admin_secret]) == ["admin-admin.nk"]


def _handshake(cert: Path, key: Path, ca: Path, hostname: str) -> None:
    """A TLS handshake in memory: a client verifying with `ca` that the server holding
    `cert` is `hostname` (OpenSSL's own checks). Raises ssl.SSLCertVerificationError."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(ca))
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=hostname)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(20):
        for who, end, out, peer in (
            ("client", client, c_out, s_in),
            ("server", server, s_out, c_in),
        ):
            if not done[who]:
                try:
                    end.do_handshake()
                    done[who] = True
                except ssl.SSLWantReadError:
                    pass
            if data := out.read():
                peer.write(data)
        if all(done.values()):
            return
    raise AssertionError(f"no handshake for {hostname}")


def test_the_certificate_is_for_every_name_the_pods_and_the_service_use(generated: Path) -> None:
    hosts = set(SERVICE_NAMES)
    for _name, _pod, container in hookbus_containers():
        for server in container_env(container)["NATS_URL"].split(","):
            hosts.add(urlsplit(server.strip()).hostname or "")
    files = [generated / f for f in ("server-cert.pem", "server-key.pem", "ca.pem")]
    for host in sorted(hosts):
        _handshake(*files, host)
    for other in ("nats.other.svc", "nats-3.nats", "example.com"):  # the check is real
        with pytest.raises(ssl.SSLCertVerificationError, match="match"):
            _handshake(*files, other)


def test_auth_init_san_refuses_what_cannot_be_in_the_certificate(tmp_path: Path) -> None:
    for extra, said in (
        (["--san", "not a name"], "not a DNS name or an IP address: 'not a name'"),
        (["--san", "nats", "--no-tls"], "--san names go into the certificate"),
        (["--san", "nats", "--tls-cert", "c.pem", "--tls-key", "k.pem"], "--tls-cert"),
    ):
        out = tmp_path / "auth"
        result = CliRunner().invoke(cli, ["auth", "init", "--out", str(out), *extra])
        assert result.exit_code == 2, result.output
        assert said in result.output
        assert not out.exists()


def test_a_pods_configuration_alone_provisions_a_tls_server(
    generated: Path, tmp_path: Path
) -> None:
    """The Job's command and environment, with only what its volume holds (the admin's
    seed and the CA, no `hookbus auth init` folder beside them), against nats-server run
    over TLS with the generated config (on loopback: its URL names localhost, one of the
    certificate's names; one server, so one replica)."""
    ((_name, pod, container),) = [
        w for w in hookbus_containers() if command_line(w[2]["args"])[0] == ["auth", "provision"]
    ]
    env = container_env(container)
    made = created_objects(generated)
    volume = tmp_path / "etc-hookbus"  # what the projected volume holds, nothing else
    volume.mkdir()
    for var in ("NATS_NKEY", "NATS_CA"):
        kind, name, key = mounted_file(pod, container, env[var])
        target = volume / Path(env[var]).name
        shutil.copy(made[(kind, name)][key], target)
        env[var] = str(target)
    args = list(container["args"])
    args[args.index("--replicas") + 1] = "1"
    with EmbeddedNatsServer(tmp_path / "nats", config=generated / "server.conf", port=-1,
                            host="127.0.0.1") as server:  # fmt: skip
        port = urlsplit(server.url).port
        env["NATS_URL"] = f"nats://localhost:{port}"
        clean = {k: v for k, v in os.environ.items()
                 if not k.startswith(("NATS_", "HOOKBUS_", "OTEL_"))}  # fmt: skip
        done = subprocess.run(
            [*HOOKBUS, *args],
            capture_output=True, text=True, timeout=60, env={**clean, **env},
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        for stream in ("KV_hookbus_handlers", "KV_hookbus_approvals", "hookbus_decisions"):
            assert f"{stream}: ready" in done.stdout, done.stdout
        plain = subprocess.run(  # the same without the CA: the server is not trusted
            [*HOOKBUS, *args],
            capture_output=True, text=True, timeout=60,
            env={**clean, **{k: v for k, v in env.items() if k != "NATS_CA"}},
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert plain.returncode == 1, plain.stdout + plain.stderr
        assert "TLS with NATS at" in plain.stderr and "system's CAs" in plain.stderr, plain.stderr
