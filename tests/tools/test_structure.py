"""The code's shape, checked from its source: no import circle (deferred and TYPE_CHECKING imports
count); the platforms a near-leaf and config.py free of them; device questions only in the platform, the attention backends and the kernels; the
weight formats never import model code; no assertion in the tests whose condition hides in its
message (`assert ok, text and other_check` never evaluates other_check)."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nanovllm"


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules path imports anywhere (functions' deferred imports and those under
    `if TYPE_CHECKING:` included: a circle a type hint hides is still a circle), resolved to the
    longest known module name."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import module` imports that module; `from module import name`, the module
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: imports_of(p, set(files)) - {m} for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    """None anywhere in the package (layers/, models/ and loader/ held one of 17 modules together by
    deferred imports before)."""
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_weight_formats_import_no_model_code():
    graph = import_graph()
    for module, deps in graph.items():
        if module.startswith("nanovllm.layers.quantization"):
            outside = sorted(d for d in deps if d.startswith("nanovllm.models")
                             or (d.startswith("nanovllm.layers") and not d.startswith("nanovllm.layers.quantization")))
            assert outside == [], module
    for layer in ("nanovllm.layers.linear", "nanovllm.layers.embed_head", "nanovllm.layers.moe"):
        formats = sorted(d for d in graph[layer] if d.startswith("nanovllm.layers.quantization"))
        assert set(formats) <= {"nanovllm.layers.quantization.base", "nanovllm.layers.quantization.parameter"}, layer


def test_device_questions_only_in_the_platform_backends_and_kernels():
    allowed = ("platforms", "layers/backends", "kernels")
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).as_posix().startswith(allowed):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.is_cuda\b|device\.type\b", line):
                found.append(f"{path.relative_to(ROOT)}:{i}")
    assert found == []


def test_no_test_hides_a_check_in_an_assertion_message():
    hidden = []
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assert) and isinstance(node.msg, (ast.BoolOp, ast.Compare)):
                hidden.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Assert) and isinstance(node.test, ast.Tuple):
                hidden.append(f"{path.relative_to(ROOT)}:{node.lineno} (a tuple is always true)")
    assert hidden == []


def test_the_hidden_check_finder_finds_one():
    node = ast.parse("assert r.status == 200, r.text and r.json()['model'] == 'm'").body[0]
    assert isinstance(node.msg, ast.BoolOp)


def functions_with_a_conditional_inside(text: str) -> list[str]:
    """Names of the C functions in text whose body holds an #if / #elif / #else (a function per
    instruction set instead: each definition under a file-level guard)."""
    found, depth, current, signature = [], 0, None, None
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith("#"):
            if depth > 0 and re.match(r"#\s*(if|elif|else)\b", stripped) and current not in found:
                found.append(current)
            continue
        if line.rstrip().endswith("\\"):  # a macro's body (no conditional can be inside one)
            continue
        code = re.sub(r"//.*", "", re.sub(r"/\*.*?\*/", "", line))
        if depth == 0 and not line.startswith((" ", "\t", "}")):
            m = re.match(r"^[\w\s\*()]*?\b(\w+)\s*\(", line)
            if m:
                signature = m.group(1)
        before = depth
        depth += code.count("{") - code.count("}")
        if before == 0 and depth > 0:
            current = signature
    return found


def test_each_c_function_holds_one_instruction_set():
    kernels = PACKAGE / "kernels"
    mixed = {path.name: functions_with_a_conditional_inside(path.read_text())
             for path in sorted([*kernels.glob("*.c"), *kernels.glob("*.h")])}
    assert {name: found for name, found in mixed.items() if found} == {}


def test_the_conditional_finder_finds_one():
    text = "static int f(int x) {\n#if A\n    return 1;\n#else\n    return 2;\n#endif\n}\n#if A\nint g(void) { return 0; }\n#endif\n"
    assert functions_with_a_conditional_inside(text) == ["f"]


def downloads_in(text: str) -> list[str]:
    """The pip downloads and installs a test source starts (pip's argv in a subprocess call)."""
    return re.findall(r"""["']pip["'],\s*["'](?:download|install)["']""", text)


def test_no_test_downloads_at_test_time():
    """A package or file a test reads is installed by .ci/run or kept in tests/data: a download inside
    the suite (an sdist fetched for one template file) depends on the network and on how pip builds it.
    (The default model's own fetch is the product's code, tested as such in test_default_model.py.)"""
    found = {str(p.relative_to(ROOT)): downloads_in(p.read_text()) for p in (ROOT / "tests").rglob("*.py")
             if p.name != "test_structure.py"}
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_the_download_finder_finds_one():
    assert downloads_in('subprocess.run([sys.executable, "-m", "pip", "download", PKG])') != []
    assert downloads_in("['pip', 'install', 'foo']") != []
    assert downloads_in("the pip cache") == []


def runner_probes(text: str) -> list[str]:
    """getattr / hasattr calls that ask what kind of runner (executor) an object is."""
    return re.findall(r"(?:getattr|hasattr)\(\s*[\w.]*(?:runner|executor)\b[^)]*\)|"
                      r"(?:getattr|hasattr)\(\s*self,\s*[\"'](?:model_runner|runner|executor)[\"']", text)


def test_no_probe_of_a_runner():
    """The engine, the scheduler and the speculator call the Executor contract
    (executor/abstract.py), which the single-process and tensor-parallel runners both answer."""
    found = {str(p.relative_to(ROOT)): runner_probes(p.read_text()) for p in PACKAGE.rglob("*.py")}
    # NOTE: dispatch by the method name a call channel carries is not a probe.
    allowed = {"getattr(self.runner, method)", "getattr(runner, method)"}
    assert {name: [h for h in hits if h not in allowed] for name, hits in found.items()
            if set(hits) - allowed} == {}


def test_the_probe_finder_finds_one():
    assert runner_probes('runner = getattr(self.model_runner, "runner", self.model_runner)') != []
    assert runner_probes('if hasattr(model_runner, "prepare_rows"):') != []
    assert runner_probes('runner = getattr(self, "model_runner", None)') != []
    assert runner_probes("getattr(config, 'x')") == []


def test_no_test_module_imports_another():
    """What test modules share lives in helper modules beside tests/conftest.py or in a folder's
    conftest.py; a test module's own name in a subprocess it starts is not another module."""
    found = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        names = set(re.findall(r"(?:^|[;\n]\s*)(?:from|import) (test_\w+)", path.read_text())) - {path.stem}
        if names:
            found[str(path.relative_to(ROOT))] = sorted(names)
    assert found == {}


ISA_MACRO = re.compile(r"\b__(?:AVX\w*|F16C|FMA|SSE\w*|BMI\w*|ARM_\w+|aarch64)__\b")


def test_only_isa_h_names_the_compilers_instruction_set_macros():
    """kernels/isa.h says once what a build has (ISA_*); the kernels test those."""
    kernels = PACKAGE / "kernels"
    naming = sorted(p.name for p in [*kernels.glob("*.c"), *kernels.glob("*.h")] if ISA_MACRO.search(p.read_text()))
    assert naming == ["isa.h"]


def c_call_graph(files: dict[str, str]) -> dict[str, set[str]]:
    """file -> the other C files whose non-static functions it calls."""
    defined = {name: set(re.findall(r"^(?!static\b)[A-Za-z_][\w \*]*?\b(\w+)\s*\([^;{]*\)\s*\{", text, re.M))
               for name, text in files.items()}
    graph = {}
    for name, text in files.items():
        code = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        graph[name] = {other for other, funcs in defined.items() if other != name
                       and any(re.search(rf"\b{f}\s*\(", code) for f in funcs)}
    return graph


def test_no_call_circle_between_c_files():
    kernels = PACKAGE / "kernels"
    assert cycles(c_call_graph({p.name: p.read_text() for p in kernels.glob("*.c")})) == []


def test_the_c_call_graph_sees_a_circle():
    files = {"a.c": "int f(void) {\n    return g();\n}\n", "b.c": "int g(void) {\n    return f();\n}\n",
             "c.c": "static int h(void) {\n    return f();\n}\n"}
    assert c_call_graph(files) == {"a.c": {"b.c"}, "b.c": {"a.c"}, "c.c": {"a.c"}}
    assert cycles(c_call_graph(files)) == [["a.c", "b.c"]]


def test_no_executor_module_imports_a_model():
    """The executor walks what the layers describe (layers/c_description.py) and builds the class
    the config resolved: it knows no model family."""
    graph = import_graph()
    found = {m: sorted(d for d in deps if d.startswith("nanovllm.models"))
             for m, deps in graph.items() if m.startswith("nanovllm.executor")}
    assert {m: deps for m, deps in found.items() if deps} == {}


def test_each_c_description_is_registered_where_its_class_is_defined():
    """A layer describes itself to the C step in its own file: a new layer kind (a LoRA-wrapped
    projection, a Mamba-2 mixer, MLA) is a change there, not in the executor."""
    import importlib
    import pkgutil

    import nanovllm.models
    for info in pkgutil.iter_modules(nanovllm.models.__path__):  # every family's module: every registration
        importlib.import_module(f"nanovllm.models.{info.name}")
    from nanovllm.layers.c_description import REGISTERED_IN
    assert len(REGISTERED_IN) >= 10
    assert {cls.__name__: where for cls, where in REGISTERED_IN.items() if where != cls.__module__} == {}


def test_the_platforms_are_a_near_leaf_and_config_does_not_import_them():
    """A platform answers traits in plain values (torch and utils/ only): the rooms that act on them
    map its answers to their objects. config.py resolves it through EngineArgs.device_platform."""
    graph = import_graph()
    for module, deps in graph.items():
        if module.startswith("nanovllm.platforms"):
            outside = sorted(d for d in deps if not d.startswith(("nanovllm.platforms", "nanovllm.utils")))
            assert outside == [], module
    assert not any(d.startswith("nanovllm.platforms") for d in graph["nanovllm.config"])


def performance_citations(text: str) -> tuple[list[str], list[str]]:
    """(the names cited as docs/performance.md, "Name" or ("Name"), the diary-item citations)."""
    names = re.findall(r'performance\.md,? \(?"([^"]+)"', text)
    items = re.findall(r"performance\.md[^\n]{0,24}?\bitems? \d+", text)
    return names, items


def test_code_and_docs_cite_the_performance_guide_by_its_decisions_names():
    """docs/performance.md is a guide of at most 600 lines; what cites it names one of its headings
    (stable names), never an item number of the diary it replaced."""
    guide = (ROOT / "docs" / "performance.md").read_text()
    assert len(guide.splitlines()) <= 600
    headings = set(re.findall(r"^#+ (.+)$", guide, re.M))
    files = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".c", ".h", ".md", ".sh", ".toml", ".txt")
             and not any(part.startswith(".") or part in ("build", "node_modules") for part in p.relative_to(ROOT).parts)]
    unknown, items = {}, {}
    for path in files:
        names, cited_items = performance_citations(path.read_text(errors="replace"))
        if path.name == "test_structure.py":
            continue
        if set(names) - headings:
            unknown[str(path.relative_to(ROOT))] = sorted(set(names) - headings)
        if cited_items:
            items[str(path.relative_to(ROOT))] = cited_items
    assert unknown == {} and items == {}


def test_the_citation_finder_finds_both_kinds():
    text = 'see docs/performance.md, "The C decode step"; (docs/performance.md item 42) and performance.md ("X")'
    assert performance_citations(text) == (["The C decode step", "X"], ["performance.md item 42"])


def test_the_engine_core_reads_in_one_sitting():
    """No file in engine/ is over 300 lines: a capability that grows one gets a room of its own."""
    long = {p.name: n for p in (PACKAGE / "engine").glob("*.py") if (n := len(p.read_text().splitlines())) > 300}
    assert long == {}
