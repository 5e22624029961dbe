"""agent/deploy/kubernetes-multinode.yaml: one EP group over several nodes (leader and worker
StatefulSets behind one headless Service), the agent a native sidecar of the leader pod only, the
rendezvous at the leader's stable name. Validated offline; its command lines parse with torchrun's
and `python -m moewatch.runtime`'s own parsers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from moewatch.agent.config import build_config

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "agent" / "deploy" / "kubernetes-multinode.yaml"
KUBERNETES_VALIDATE = str(Path(sys.executable).parent / "kubernetes-validate")


def validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([KUBERNETES_VALIDATE, "--strict", "-k", "1.29", str(path)], capture_output=True, text=True,
                          timeout=120)


def expand(args: list[str], env: list[dict], pod_name: str) -> list[str]:
    """Kubernetes' $(VAR) expansion of a container's args: literal env values and metadata.name."""
    values = {}
    for e in env:
        if "value" in e:
            values[e["name"]] = e["value"]
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            values[e["name"]] = pod_name
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in args]


def test_multinode_example_validates_offline_and_fails_on_a_typo(tmp_path):
    result = validate(MANIFEST)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = tmp_path / "bad.yaml"
    broken.write_text(MANIFEST.read_text().replace("podManagementPolicy: Parallel",
                                                   "podManagementPolicy: Parallel\n  podManagementPolicyy: x", 1))
    assert validate(broken).returncode != 0


def test_one_agent_per_group_on_the_leader_and_a_rendezvous_every_node_reaches(tmp_path):
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    sets = {d["metadata"]["labels"]["moewatch.io/role"]: d for d in docs if d["kind"] == "StatefulSet"}
    leader, worker = sets["leader"], sets["worker"]
    svc = service["metadata"]["name"]
    for s in (leader, worker):
        assert s["spec"]["serviceName"] == svc
        labels = s["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items()), "the Service selects it"
        assert s["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert leader["spec"]["replicas"] == 1
    # The agent: a native sidecar of the leader pod only, sharing the socket with the inference container.
    pod = leader["spec"]["template"]["spec"]
    sidecar = next(c for c in pod["initContainers"] if c["name"] == "moewatch")
    assert sidecar["restartPolicy"] == "Always" and sidecar["readinessProbe"]["httpGet"]["port"] == "metrics"
    assert "initContainers" not in worker["spec"]["template"]["spec"]
    assert not any("moewatch-agent" in c["image"] for c in worker["spec"]["template"]["spec"]["containers"])
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    agent_yaml = tmp_path / "agent.yaml"
    agent_yaml.write_text(config_map["data"]["agent.yaml"])
    cfg = build_config(flags=None, environ={}, config_path=str(agent_yaml))
    inference = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in inference["env"]}
    assert env["MOEWATCH_SOCKET"] == cfg.server.socket
    socket_dir = str(Path(cfg.server.socket).parent)
    for container in (sidecar, inference):
        assert any(m["mountPath"] == socket_dir and m["name"] == "moewatch-socket" for m in container["volumeMounts"])
    assert leader["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9477"

    # torchrun on every node: the same group, c10d at the leader's stable name, and moewatch.runtime's flags.
    from torch.distributed.run import get_args_parser

    from moewatch.runtime.__main__ import _command

    leader_pod = f"{leader['metadata']['name']}-0"
    parsed = {}
    for role, s in sets.items():
        container = s["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["torchrun"]
        args = expand(container["args"], container["env"], f"{s['metadata']['name']}-0")
        torchrun = get_args_parser().parse_args(args)
        assert torchrun.rdzv_backend == "c10d" and torchrun.module and torchrun.training_script == "moewatch.runtime"
        host, port = torchrun.rdzv_endpoint.rsplit(":", 1)
        assert host == f"{leader_pod}.{svc}" and int(port) in [p["port"] for p in service["spec"]["ports"]]
        assert torchrun.rdzv_conf == f"is_host={'true' if role == 'leader' else 'false'}"
        ctx = _command().make_context("moewatch.runtime", list(torchrun.training_script_args))
        parsed[role] = (torchrun, ctx.params)
    (lt, lp), (wt, wp) = parsed["leader"], parsed["worker"]
    assert lp == wp, "every node runs the same group"
    assert (lt.rdzv_id, lt.nproc_per_node) == (wt.rdzv_id, wt.nproc_per_node)
    assert int(lt.nnodes) == int(wt.nnodes) == leader["spec"]["replicas"] + worker["spec"]["replicas"]
    # c10d numbers nodes in the order of their addresses: the leader's sorts first, so global rank 0
    # (windows and the agent link) runs beside the agent.
    assert lt.local_addr == f"{leader_pod}.{svc}" and wt.local_addr == f"{worker['metadata']['name']}-0.{svc}"
    assert sorted([wt.local_addr, lt.local_addr])[0] == lt.local_addr
