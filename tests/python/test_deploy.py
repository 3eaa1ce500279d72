"""deploy/kubernetes as a cluster would take it: every object valid against the
Kubernetes API schemas (offline, strict: unknown fields fail), the ConfigMap's serve
config accepted by `embank serve --check-config`, its cluster file naming every shard
of the StatefulSet by its DNS name behind the headless Service, and the trainer Job
running a script and options that exist."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
KUBERNETES = "1.35.0"  # a recent API the schemas of the pinned kubernetes-validate cover


def objects() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for f in sorted(DEPLOY.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def one(kind: str) -> dict[str, Any]:
    (o,) = [d for d in objects() if d["kind"] == kind]
    return o


def test_every_object_is_valid_kubernetes() -> None:
    kinds = sorted(d["kind"] for d in objects())
    assert kinds == ["ConfigMap", "Job", "Service", "StatefulSet"]
    for d in objects():
        kubernetes_validate.validate(d, KUBERNETES, strict=True)
    # The check can fail: a misspelt field is refused.
    bad = one("StatefulSet")
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES, strict=True)


def test_the_serve_config_starts(tmp_path: Path) -> None:
    """The ConfigMap's serve.toml, its paths moved under tmp_path (the token and TLS
    files made here as the Secrets hold them), passes `embank serve --check-config`."""
    etc = tmp_path / "etc"
    (etc / "token").mkdir(parents=True)
    (etc / "token" / "token").write_text("s3cret\n")
    embank = [sys.executable, "-m", "embank"]
    subprocess.run([*embank, "cert", "--out", str(etc / "tls")], check=True, capture_output=True, timeout=60)
    text = one("ConfigMap")["data"]["serve.toml"]
    text = text.replace("/etc/embank/", f"{etc}/").replace("/data/store", str(tmp_path / "store"))
    config = tmp_path / "serve.toml"
    config.write_text(text)
    check = [*embank, "serve", "--config", str(config), "--check-config"]
    out = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("config ok: a primary"), out.stdout
    assert "warning" not in out.stdout
    # And it fails when it should: a key the server does not know.
    config.write_text(text.replace("[limits]", "[limits]\nconnexions_max = 3"))
    out = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "connexions_max" in out.stderr


def test_the_cluster_file_names_every_shard() -> None:
    sts, svc = one("StatefulSet"), one("Service")
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "protocol")
    cluster = tomllib.loads(one("ConfigMap")["data"]["cluster.toml"])
    name, service = sts["metadata"]["name"], svc["metadata"]["name"]
    dns = f"{service}.default.svc.cluster.local:{port}"
    want = [[f"{name}-{i}.{dns}"] for i in range(sts["spec"]["replicas"])]
    assert [s["replicas"] for s in cluster["shards"]] == want
    container = sts["spec"]["template"]["spec"]["containers"][0]
    # Readiness waits for a replica's first checkpoint; liveness must not (a replica
    # waiting for it would be restarted over and over).
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"


def test_the_trainer_runs_what_exists() -> None:
    args = one("Job")["spec"]["template"]["spec"]["containers"][0]["args"]
    script = next(a for a in args if a.endswith(".py"))
    assert (ROOT / script).exists(), script
    helped = subprocess.run(
        [sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert helped.returncode == 0, helped.stderr
    for a in args[args.index(script) + 1 :]:
        assert a.split("=")[0] in helped.stdout, a
