"""How the CPU's OpenMP threads wait between parallel regions: the engine's default, set before
torch loads its OpenMP runtime (libgomp reads its environment once, when it is loaded).

A decode step is hundreds of short parallel regions. libgomp's own default spins a waiting thread
for 300,000 iterations (a few ms) before it sleeps: fastest on an idle machine, but with another
process on the cores the spinning threads take the time the working ones need (32 tokens: 0.91 s
idle, 13.8 s beside a second engine). OMP_WAIT_POLICY=PASSIVE (sleep at once) holds up under load
(1.58 s) but costs ~20% idle (1.09 s). A short spin, GOMP_SPINCOUNT=3000, holds both: 1.01 s idle,
1.88 s beside a second engine, as PASSIVE beside a busy loop per core (scripts/bench_threads.py;
docs/performance.md, "OpenMP threads").
A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is left as it is.
"""
import os
import sys

SPIN_ENV = "GOMP_SPINCOUNT"
DEFAULT_SPINS = "3000"
USER_ENVS = ("OMP_WAIT_POLICY", SPIN_ENV)

# What set_wait_default() found: "user" (their variables kept), "set" (ours, before torch loaded),
# "late" (torch was imported first: this process keeps libgomp's default; child processes get ours).
wait_setting = None


def set_wait_default() -> str:
    global wait_setting
    if any(name in os.environ for name in USER_ENVS):
        wait_setting = "user"
    else:
        wait_setting = "late" if "torch" in sys.modules else "set"
        os.environ[SPIN_ENV] = DEFAULT_SPINS
    return wait_setting


def wait_note() -> str | None:
    """A line for the start-up log when this process could not take the engine's default."""
    if wait_setting != "late":
        return None
    return (f"torch was imported before nanovllm, so its OpenMP threads keep libgomp's long spin, which "
            f"slows decoding when other processes share the cores; import nanovllm first or set "
            f"{SPIN_ENV}={DEFAULT_SPINS} (or OMP_WAIT_POLICY=PASSIVE)")


def environ_for_other_programs() -> dict[str, str]:
    """os.environ without the engine's own wait default, for another program run beside the engine
    (llama.cpp in the side-by-side benchmark keeps its own OpenMP default, as its users run it)."""
    env = dict(os.environ)
    if wait_setting in ("set", "late") and env.get(SPIN_ENV) == DEFAULT_SPINS:
        del env[SPIN_ENV]
    return env
