"""Fixtures ``flower_deployment``: a real Flower deployment on loopback (SuperLink + SuperNodes, free ports chosen
at run time), and ``flower_simulation``: a SuperLink running Flower's simulation runtime (Ray) with simulated
SuperNodes; both run examples/flower with ``flwr run``, and afterwards no process they started is left.

Every process of a deployment carries ``PYFEDKERN_FLOWER_DEPLOYMENT=<tag>`` in its environment (children inherit
it), so the deployment finds all of them in /proc, also those that left our process groups: the SuperLink starts
its SuperExec with ``start_new_session=True``, and processes whose parent died are re-parented to init.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import pyfedkern

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "examples" / "flower"
BIN = Path(sys.executable).parent
TAG_VARIABLE = "PYFEDKERN_FLOWER_DEPLOYMENT"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"port {port} did not open in {timeout} s:\n{log.read_text()[-3000:]}")


def tagged_processes(tag: str) -> list[int]:
    """PIDs of the live processes whose environment has ``TAG_VARIABLE=tag`` (zombies have none and are left out)."""
    needle = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return sorted(found)


def command_of(pid: int) -> str:
    """The command line of process ``pid`` ("" when it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def end_tagged(tag: str, timeout: float = 10.0) -> None:
    """SIGTERM every process tagged ``tag``, then SIGKILL those still alive after ``timeout`` seconds; returns
    once none is left (TimeoutError if some survive SIGKILL). PIDs are re-read before each signal, so only tagged
    processes are ever signalled."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tagged_processes(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.monotonic() + timeout
        while tagged_processes(tag) and time.monotonic() < end:
            time.sleep(0.1)
        if not tagged_processes(tag):
            return
    raise TimeoutError(f"processes survived SIGKILL: {[(p, command_of(p)) for p in tagged_processes(tag)]}")


def stop(proc: subprocess.Popen) -> None:
    """Terminate a process group we started (SIGTERM, then SIGKILL)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


class Deployment:
    """A SuperLink and ``nodes`` SuperNodes (partition-id 0..nodes-1) in ``workdir``, or with ``simulation`` a
    SuperLink in simulation mode whose runs simulate ``nodes`` SuperNodes; use as a context manager."""

    def __init__(self, workdir: Path, nodes: int, simulation: bool = False) -> None:
        self.workdir = workdir
        self.nodes = nodes
        self.simulation = simulation
        self.tag = uuid.uuid4().hex
        self.env = {**os.environ, "FLWR_HOME": str(workdir / "flwr-home"), "PYTHONUNBUFFERED": "1"}
        # The apps' processes import this pyfedkern (also when it runs from a checkout, not installed).
        source = str(Path(pyfedkern.__file__).resolve().parents[1])
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
        self.env[TAG_VARIABLE] = self.tag
        self.env["PATH"] = f"{BIN}{os.pathsep}{self.env.get('PATH', '')}"
        self.link: subprocess.Popen | None = None
        self.supernodes: list[subprocess.Popen] = []

    def _spawn(self, args: list[str], log_name: str) -> tuple[subprocess.Popen, Path]:
        log = self.workdir / log_name
        proc = subprocess.Popen(
            args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir, start_new_session=True
        )
        return proc, log

    def __enter__(self) -> Deployment:
        try:
            self.port = free_port()
            self.link, log = self._spawn(
                [
                    str(BIN / "flower-superlink"),
                    "--insecure",
                    "--port",
                    str(self.port),
                    "--disable-runtime-dependency-installation",
                    *(["--simulation", "--isolation", "subprocess"] if self.simulation else []),
                ],
                "superlink.log",
            )
            wait_port(self.port, self.link, log)
            for i in range(0 if self.simulation else self.nodes):
                node_port = free_port()
                proc, log = self._spawn(
                    [
                        str(BIN / "flower-supernode"),
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{self.port}",
                        "--port",
                        str(node_port),
                        "--node-config",
                        f"partition-id={i} num-partitions={self.nodes}",
                    ],
                    f"supernode-{i}.log",
                )
                self.supernodes.append(proc)
                wait_port(node_port, proc, log)
            home = Path(self.env["FLWR_HOME"])
            home.mkdir(parents=True, exist_ok=True)
            address = f"127.0.0.1:{self.port}"
            (home / "config.toml").write_text(
                f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "{address}"\ninsecure = true\n'
            )
        except BaseException:
            self.close()
            raise
        return self

    def processes(self) -> dict[int, str]:
        """PID → command line of every live process this deployment started, directly or not."""
        return {pid: command_of(pid) for pid in tagged_processes(self.tag)}

    def close(self) -> None:
        """Stop our process groups, then every process of the deployment still alive (e.g. the SuperExec)."""
        for proc in [*self.supernodes, *([self.link] if self.link else [])]:
            stop(proc)
        end_tagged(self.tag)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def kill_node(self, i: int) -> None:
        """SIGKILL SuperNode i and everything it started (its ClientApp processes)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.supernodes[i].pid, signal.SIGKILL)
        self.supernodes[i].wait(10)

    def run(self, run_config: dict, *, timeout: float = 300.0, on_round=None) -> tuple[np.ndarray, list[dict]]:
        """``flwr run`` the example app with ``run_config`` overrides; returns (final model, per-round history).

        ``on_round(n, record)``, when given, is called after round n (the server waits for it).
        """
        app = self.workdir / "app"
        if not app.exists():
            shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        out = self.workdir / "final.npy"
        pause = self.workdir / "pause"
        pause.mkdir(exist_ok=True)
        cfg = {**run_config, "out-file": str(out), "pause-dir": str(pause)}
        overrides = self.workdir / "run-config.toml"  # a file: JSON-valued strings break the inline syntax
        overrides.write_text("".join(f'"{k}" = {json.dumps(v)}\n' for k, v in cfg.items()))
        federation = ["--federation-config", f"num-supernodes={self.nodes}"] if self.simulation else []
        proc, _ = self._spawn(
            [str(BIN / "flwr"), "run", str(app), "local", "--run-config", str(overrides), *federation, "--stream"],
            "flwr-run.log",
        )
        try:
            end = time.monotonic() + timeout
            done_rounds = 0
            while not out.exists():
                if time.monotonic() > end:
                    raise TimeoutError(f"the run did not finish in {timeout} s:\n{self.logs()}")
                marker = pause / f"round-{done_rounds + 1}.json"
                if marker.exists():
                    done_rounds += 1
                    if on_round is not None:
                        on_round(done_rounds, json.loads(marker.read_text()))
                    (pause / f"go-{done_rounds}").touch()
                if proc.poll() is not None and not out.exists() and not marker.exists():
                    time.sleep(1.0)
                    if not out.exists():
                        raise RuntimeError(f"flwr run exited ({proc.returncode}) without a result:\n{self.logs()}")
                time.sleep(0.1)
            time.sleep(0.2)
            history = json.loads(Path(str(out) + ".history.json").read_text())
            return np.load(out), history
        finally:
            stop(proc)

    def metrics(self) -> dict:
        """The last run's per-round metrics as the example app saved them: {"train": ..., "evaluate": ...}."""
        return json.loads((self.workdir / "final.npy.metrics.json").read_text())

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-2500:]}" for p in sorted(self.workdir.glob("*.log")))


def _deployments(tmp_path: Path, simulation: bool):
    if not Path("/proc/self/environ").exists():
        pytest.skip("finding every process of a deployment needs Linux's /proc")
    started: list[Deployment] = []

    def start(nodes: int) -> Deployment:
        dep = Deployment(tmp_path, nodes, simulation).__enter__()
        started.append(dep)
        return dep

    yield start
    for dep in started:
        dep.close()
        assert dep.processes() == {}, "a process of the deployment outlived close()"


@pytest.fixture
def flower_deployment(tmp_path):
    """``flower_deployment(nodes)`` starts a deployment in tmp_path; all its processes stop after the test."""
    yield from _deployments(tmp_path, simulation=False)


@pytest.fixture
def flower_simulation(tmp_path):
    """``flower_simulation(nodes)`` starts a SuperLink running Flower's simulation runtime in tmp_path, whose runs
    simulate ``nodes`` SuperNodes with Ray; skipped without Ray. All its processes stop after the test."""
    pytest.importorskip("ray", reason="Flower's simulation runtime needs Ray: pip install 'pyfedkern[simulation]'")
    yield from _deployments(tmp_path, simulation=True)
