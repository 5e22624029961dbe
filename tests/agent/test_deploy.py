"""agent/deploy/: the systemd unit passes `systemd-analyze verify` with nothing on stderr and keeps its
security score, the Kubernetes example validates offline, the image and the agent stay torch-free."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moewatch.agent.config import build_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "agent" / "deploy"
UNIT = DEPLOY / "moewatch-agent.service"
INSTALLED_BINARY = "/opt/moewatch/bin/moewatch"
SYSTEMD_ANALYZE = "systemd-analyze"  # found on PATH (make system-deps installs it)
KUBERNETES_VALIDATE = str(Path(sys.executable).parent / "kubernetes-validate")


def verify_unit(text: str, folder: Path) -> subprocess.CompletedProcess:
    """`systemd-analyze verify` on the unit text, with the install path of the binary pointed at this
    checkout's (verify checks that ExecStart exists; nothing else is changed)."""
    moewatch = shutil.which("moewatch", path=str(Path(sys.executable).parent))
    assert moewatch, "the moewatch entry point is not installed in this environment"
    path = folder / UNIT.name
    path.write_text(text.replace(INSTALLED_BINARY, moewatch))
    return subprocess.run([SYSTEMD_ANALYZE, "verify", str(path)], capture_output=True, text=True, timeout=60)


def test_systemd_unit_raises_the_descriptor_limit():
    unit = (DEPLOY / "moewatch-agent.service").read_text()
    limits = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("LimitNOFILE=")]
    assert limits and int(limits[0]) >= 65536


def test_systemd_unit_verifies_with_nothing_on_stderr(tmp_path):
    text = UNIT.read_text()
    assert text.count(INSTALLED_BINARY) == 1
    result = verify_unit(text, tmp_path)
    assert result.returncode == 0 and result.stderr == "" and result.stdout == "", result.stderr
    keys = dict(re.findall(r"^(\w+)=(.*)$", text, re.M))
    assert keys["Type"] == "notify" and keys["WatchdogSec"] and keys["NotifyAccess"] == "main"
    # The check can fail: a misspelled key is only a warning (exit 0) but it lands on stderr.
    typo = verify_unit(text.replace("WatchdogSec=", "WatchdogSecs="), tmp_path)
    assert "WatchdogSecs" in typo.stderr


def test_systemd_security_score_is_the_documented_one():
    result = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=true", str(UNIT)], capture_output=True,
                            text=True, timeout=60)
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", result.stdout + result.stderr)
    assert match, result.stdout[-500:]
    score = float(match.group(1))
    assert score <= 2.0, f"hardening regressed: exposure {score}"
    docs = (ROOT / "docs" / "deploy.md").read_text()
    assert f"{match.group(1)} {match.group(2)}" in docs, "docs/deploy.md quotes another score"


def test_kubernetes_example_validates_and_wires_a_native_sidecar(tmp_path):
    manifest = DEPLOY / "kubernetes.yaml"
    result = subprocess.run([KUBERNETES_VALIDATE, "--strict", "-k", "1.29", str(manifest)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    docs = list(yaml.safe_load_all(manifest.read_text()))
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    build_config(flags=None, environ={}, config_path=_write(tmp_path / "agent.yaml", config["data"]["agent.yaml"]))
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == "moewatch")
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # Readiness probes the agent's own port, never the inference server's.
    assert sidecar["readinessProbe"]["httpGet"]["port"] == "metrics"
    assert {p["name"]: p["containerPort"] for p in sidecar["ports"]}["metrics"] == 9477
    socket_volume = next(v for v in pod["spec"]["volumes"] if "emptyDir" in v)["name"]
    inference = pod["spec"]["containers"][0]
    for container in (sidecar, inference):
        assert any(m["name"] == socket_volume and m["mountPath"] == "/run/moewatch" for m in container["volumeMounts"])
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9477"
    # HTTPS with basic auth: the files the config names are mounted from Secrets; probes speak HTTPS.
    cfg = build_config(flags=None, environ={}, config_path=str(tmp_path / "agent.yaml"))
    assert cfg.server.tls_cert_file and cfg.server.basic_auth_user
    assert pod["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    secrets = {v["name"] for v in pod["spec"]["volumes"] if "secret" in v}
    for path in (cfg.server.tls_cert_file, cfg.server.tls_key_file, cfg.server.basic_auth_password_file):
        assert any(path.startswith(mounts[name] + "/") for name in secrets), path
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert sidecar[probe]["httpGet"]["scheme"] == "HTTPS"
    # The check can fail: a field Kubernetes does not know is refused in strict mode.
    broken = manifest.read_text().replace("restartPolicy: Always", "restartPolicy: Always\n          restartPolicyy: Always")
    bad = subprocess.run([KUBERNETES_VALIDATE, "--strict", "-k", "1.29", _write(tmp_path / "bad.yaml", broken)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_example_config_is_valid():
    cfg = build_config(str(DEPLOY / "agent.yaml"), environ={})
    assert cfg.policy.mode == "observe" and cfg.server.listen == "127.0.0.1:9477"


def test_sidecar_image_installs_without_torch():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "pip install --no-cache-dir ." in dockerfile and "[runtime" not in dockerfile and "torch==" not in dockerfile
    from importlib.metadata import requires

    base = [r for r in requires("moewatch") or [] if "extra ==" not in r]
    assert base and not [r for r in base if re.match(r"(torch|triton)\b", r)]


def test_the_agent_never_imports_torch():
    code = ("import sys, moewatch.agent.daemon, moewatch.agent.cli, moewatch.tools.demo, moewatch.agent.top, "
            "moewatch.agent.otel, moewatch.agent.policy, moewatch.integrations.registry; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["moewatch-agent.service", "kubernetes.yaml", "Dockerfile", "agent.yaml"])
def test_deploy_files_are_documented(name):
    assert name in (ROOT / "docs" / "deploy.md").read_text()
