"""Data parallelism on one host: `nanovllm serve --data-parallel-size N` (cli.py) runs N replicas,
each a plain `nanovllm serve` process on its own port with its share of the cores (and on CUDA its
own GPUs), optionally sglang-router in front; this parent supervises them until SIGTERM/SIGINT."""
import argparse
import copy
import ctypes
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanovllm.config import Config

logger = logging.getLogger(__name__)

# The supervisor's own flags (cli.py): never passed on to a replica.
SUPERVISOR_DESTS = frozenset({"data_parallel_size", "data_parallel_base_port", "router", "router_port",
                              "router_policy"})
POLL_S = 0.2
STOP_GRACE_S = 15.0  # a replica's own shutdown is bounded (openai_server.serve) to a few seconds
RESTART_MAX_S = 30.0  # the longest wait before a dead replica is started again
STABLE_S = 60.0  # a replica up this long has its back-off reset
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class Child:
    """One supervised process: a replica or the router. A replica keeps how it was started, so
    supervise() can start it again."""
    name: str
    url: str
    process: subprocess.Popen
    ready_path: str = "/health"
    exit_logged: bool = False
    respawn: Callable[[], subprocess.Popen] | None = None
    restarts: int = 0            # in a row: reset once a restarted replica stays up STABLE_S
    restart_at: float | None = None
    started: float = field(default_factory=time.monotonic)

    def exited(self) -> bool:
        return self.process.poll() is not None


def replica_ports(args: argparse.Namespace) -> list[int]:
    """Port of each replica: the base port (default --port) + i."""
    base = args.port if args.data_parallel_base_port is None else args.data_parallel_base_port
    flag = "--port" if args.data_parallel_base_port is None else "--data-parallel-base-port"
    last = base + args.data_parallel_size - 1
    if base < 1 or last > 65535:  # port 0 would give each replica a port nobody knows
        raise ValueError(f"{flag} {base}: replica ports {base}..{last} must lie in 1..65535")
    return list(range(base, last + 1))


def local_url(host: str, port: int) -> str:
    """The URL a client on this host uses for host:port (a wildcard bind is reached on loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def replica_argv(parser: argparse.ArgumentParser, args: argparse.Namespace, port: int) -> list[str]:
    """The `nanovllm serve` command of one replica: every serve option as given, on its own port."""
    argv = [sys.executable, "-m", "nanovllm.cli", "serve"]
    for action in parser._actions:
        if action.dest in SUPERVISOR_DESTS or isinstance(action, argparse._HelpAction):
            continue
        value = port if action.dest == "port" else getattr(args, action.dest, action.default)
        if not action.option_strings:  # MODEL
            argv += [] if value is None else [str(value)]
        elif action.dest == "port" or value != action.default:
            # A JSON option (--speculative-config) goes back as JSON, not as Python's repr of it.
            text = json.dumps(value) if isinstance(value, dict) else str(value)
            argv += [action.option_strings[0]] + ([] if action.nargs == 0 else [text])
    return argv


def cpu_share(index: int, num_replicas: int) -> list[int] | None:
    """The cores of replica `index`: an equal slice (at least one) of those this process may use;
    None where the OS cannot pin processes."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    per_replica = max(1, len(cores) // num_replicas)
    start = index * per_replica % len(cores)
    return cores[start:start + per_replica]


def spawn(name: str, url: str, argv: list[str], env: dict[str, str] | None = None,
          cores: list[int] | None = None, ready_path: str = "/health") -> Child:
    """Start a child in its own session (a terminal's Ctrl-C reaches only this parent, which then
    stops the children once); on Linux it also gets SIGTERM when this parent dies, even by SIGKILL."""
    parent = os.getpid()

    def in_child() -> None:  # between fork and exec
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if cores is not None:
            os.sched_setaffinity(0, cores)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    def start() -> subprocess.Popen:
        return subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=in_child)

    process = start()
    logger.info("%s: pid %d, %s", name, process.pid, url)
    return Child(name, url, process, ready_path, respawn=start)


def is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_until_ready(children: list[Child]) -> str | None:
    """Block until every child answers 200 on its ready_path; why not, when one exits first."""
    pending = list(children)
    while pending:
        for child in list(pending):
            if child.exited():
                return f"{child.name} exited with status {child.process.returncode} before it was ready"
            if is_ready(child.url + child.ready_path):
                logger.info("%s ready at %s", child.name, child.url)
                pending.remove(child)
        time.sleep(POLL_S)
    return None


def router_argv(args: argparse.Namespace, worker_urls: list[str]) -> list[str]:
    """sglang-router's command in front of the replicas (run by --router, printed otherwise)."""
    log_level = {"warning": "warn"}.get(args.log_level, args.log_level)
    # NOTE: health checks every second, one failure enough: a dead replica leaves the rotation at
    # once (sglang-router's defaults keep it for up to three minutes; docs/scale-out.md).
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", args.host,
            "--port", str(args.router_port), "--policy", args.router_policy, "--log-level", log_level,
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--worker-urls", *worker_urls]


def stop(children: list[Child]) -> None:
    """SIGTERM every live child, wait STOP_GRACE_S for them all, then SIGKILL the rest."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for child in children:
        if not child.exited():
            child.process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0f s; killing it", child.name, STOP_GRACE_S)
            child.process.kill()
            child.process.wait()


def supervise(replicas: list[Child], router: Child | None) -> int:
    """Log each child that exits (the others keep serving) and start a replica again after a
    back-off (1 s, doubling to RESTART_MAX_S while it keeps dying); the router's health checks take
    it out of rotation meanwhile and back in once it answers. Returns only on a signal."""
    while True:
        now = time.monotonic()
        for child in replicas + ([router] if router else []):
            if child.exited() and not child.exit_logged:
                child.exit_logged = True
                alive = sum(not r.exited() for r in replicas)
                logger.error("%s (pid %d) exited with status %s; %d of %d replicas still serving",
                             child.name, child.process.pid, child.process.returncode, alive, len(replicas))
                if child.respawn is not None:
                    if now - child.started >= STABLE_S:
                        child.restarts = 0
                    delay = min(RESTART_MAX_S, 2.0 ** child.restarts)
                    child.restart_at = now + delay
                    logger.info("%s: starting it again in %.0f s", child.name, delay)
            if child.exited() and child.restart_at is not None and now >= child.restart_at:
                child.process, child.started, child.restart_at = child.respawn(), now, None
                child.restarts += 1
                child.exit_logged = False
                logger.warning("%s restarted (pid %d, restart %d in a row) at %s", child.name,
                               child.process.pid, child.restarts, child.url)
        time.sleep(POLL_S)


def run_replicas(parser: argparse.ArgumentParser, args: argparse.Namespace, model: str, config: "Config") -> int:
    """Start, announce and supervise the replicas (and the router with --router) until a signal.
    `config` is one replica's Config, already validated; the ports are already checked."""
    n = args.data_parallel_size
    envs = [config.platform.replica_env(i, n, config.tensor_parallel_size) for i in range(n)]  # raises first
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    children: list[Child] = []
    try:
        start_replicas(parser, args, model, config, envs, children)
        problem = wait_until_ready(children)
        if problem:
            logger.error("%s; stopping the others", problem)
            return 1
        urls = [child.url for child in children]
        router = None
        if args.router:
            # sglang-router's /health is 200 at once; /readiness waits for healthy workers.
            router = spawn("router", local_url(args.host, args.router_port), router_argv(args, urls),
                           ready_path="/readiness")
            router.respawn = None  # only replicas are started again; a router that dies is logged
            children.append(router)
            problem = wait_until_ready([router])
            if problem:
                logger.error("%s; stopping the replicas", problem)
                return 1
        _announce(args, urls, router)
        return supervise(children[:n], router)
    except KeyboardInterrupt:
        logger.info("stopping %d replica(s) on signal", n)
        return 0
    finally:
        stop(children)


def start_replicas(parser: argparse.ArgumentParser, args: argparse.Namespace, model: str, config: "Config",
                   envs: list[dict[str, str]], children: list[Child]) -> None:
    """Spawn replica i on port i with envs[i] and its cores, appending each to `children` as it starts."""
    n = args.data_parallel_size
    child_args = copy.copy(args)
    child_args.model = model  # resolved once here, so the replicas never fetch the default model at once
    if args.cpu_kvcache_bytes is None:  # N engines share the RAM (the platform says None where measured)
        child_args.cpu_kvcache_bytes = config.platform.default_kvcache_bytes(config.tensor_parallel_size * n)
    for i, port in enumerate(replica_ports(args)):
        cores = cpu_share(i, n)
        threads = len(cores) if cores else max(1, (os.cpu_count() or 1) // n)
        env = {**os.environ, **envs[i], "OMP_NUM_THREADS": str(threads), "PYTHONPATH": _python_path()}
        command = replica_argv(parser, child_args, port)
        children.append(spawn(f"replica {i}", local_url(args.host, port), command, env, cores))


def _announce(args: argparse.Namespace, urls: list[str], router: Child | None) -> None:
    """The command's output: where the replicas are, and the router to put in front."""
    print(f"{len(urls)} replica{'s' if len(urls) > 1 else ''} ready: {' '.join(urls)}", flush=True)
    if router is not None:
        print(f"sglang-router ({args.router_policy}) in front at {router.url}", flush=True)
    else:
        command = ["python"] + router_argv(args, urls)[1:]
        print(f"put a router in front: {shlex.join(command)}", flush=True)


def _python_path() -> str:
    """PYTHONPATH that makes a replica import this very nanovllm, wherever it was started from."""
    import nanovllm
    root = os.path.dirname(os.path.dirname(os.path.abspath(nanovllm.__file__)))
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt
