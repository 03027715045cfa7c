"""The README as a newcomer reads it: its first screen holds the two commands, the CPU commands take
PyTorch's CPU wheels, .ci/run runs exactly the README's test command, and every docs/ page it
points to exists (and every page is pointed to)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
FIRST_SCREEN = 40  # lines


def bash_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, command) of each ```bash block's single command line."""
    out = []
    for m in re.finditer(r"```bash\n(.*?)```", text, re.S):
        line = text[:m.start()].count("\n") + 1
        out += [(line, c) for c in m.group(1).splitlines() if c.strip()]
    return out


def test_first_screen_holds_the_two_commands():
    blocks = bash_blocks(README)
    main_job = [(n, c) for n, c in blocks if c.endswith("python example.py")]
    tests = [(n, c) for n, c in blocks if c.endswith("python -m pytest -q")]
    assert main_job and tests
    assert main_job[0][0] < FIRST_SCREEN and tests[0][0] < FIRST_SCREEN
    assert CPU_TORCH in main_job[0][1] and CPU_TORCH in tests[0][1]  # the CPU machine's command first
    gpu = [c for _, c in main_job if CPU_TORCH not in c]
    assert gpu and "pip install torch==2.13.0 &&" in gpu[0] and ".[gguf,cuda]" in gpu[0]


def test_ci_runs_exactly_the_readme_test_command():
    (test_command,) = [c for _, c in bash_blocks(README) if c.endswith("python -m pytest -q")]
    steps = test_command.split(" && ")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    at = 0
    for step in steps:
        found = next((i for i in range(at, len(ci)) if ci[i].startswith(step)), None)
        assert found is not None, f".ci/run lacks the README step {step!r} (after line {at})"
        at = found + 1
    assert ci[-1] == steps[-1]  # and ends with the test command itself


def test_every_docs_page_is_linked_and_exists():
    named = set(re.findall(r"docs/[\w-]+\.md", README))
    assert named and all((ROOT / n).is_file() for n in named), named
    assert {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} == named
