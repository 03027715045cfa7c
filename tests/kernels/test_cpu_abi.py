"""The ABI between ctypes and the C kernels, checked field by field and function by function: every
structure field's offset (two fields of one size swapped keep a structure's size, not its offsets),
and every function CpuKernels types against its C definition's parameters."""
import ctypes
import re
from pathlib import Path

import pytest

from nanovllm.kernels import cpu_structs

KERNELS = Path(cpu_structs.__file__).parent


def test_every_field_lies_where_c_puts_it(kernels):
    cpu_structs.check_abi(kernels.lib)  # what load() ran: passes on the structures as they are
    for struct in cpu_structs.STRUCTS:
        assert kernels.lib.nanovllm_field_count(struct.__name__.encode()) == len(struct._fields_)


def swapped(struct: type[ctypes.Structure], a: str, b: str) -> type[ctypes.Structure]:
    """The same structure (same name, same size) with fields a and b trading places."""
    fields = list(struct._fields_)
    i, j = [k for k, (name, *_) in enumerate(fields) if name in (a, b)]
    fields[i], fields[j] = fields[j], fields[i]
    return type(struct.__name__, (ctypes.Structure,), {"_fields_": fields})


@pytest.mark.parametrize("struct, a, b", [(cpu_structs.Linear, "n", "k"), (cpu_structs.DecodeStep, "slots", "positions"),
                                          (cpu_structs.DecoderModel, "eps", "scale")])
def test_two_swapped_fields_of_one_size_are_refused(kernels, struct, a, b):
    wrong = swapped(struct, a, b)
    assert ctypes.sizeof(wrong) == ctypes.sizeof(struct)  # the size check alone passes
    with pytest.raises(RuntimeError, match=rf"{struct.__name__}\.({a}|{b}) is at byte \d+ in C"):
        cpu_structs.check_abi(kernels.lib, (wrong,))


def test_a_field_c_does_not_have_is_refused(kernels):
    fields = [("datum" if name == "data" else name, *rest) for name, *rest in cpu_structs.Linear._fields_]
    renamed = type("Linear", (ctypes.Structure,), {"_fields_": fields})
    with pytest.raises(RuntimeError, match=r"Linear\.datum is at byte -1 in C"):
        cpu_structs.check_abi(kernels.lib, (renamed,))


# ---- the functions: ctypes' argtypes against the C definitions ------------------------------------
C_SCALARS = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}


def c_definitions() -> dict[str, tuple[str, list[str]]]:
    """name -> (return type, parameter types) of every non-static function the C files (and the
    bodies cpu_quant.c includes) define."""
    found = {}
    for path in [*KERNELS.glob("*.c"), *KERNELS.glob("*.h")]:
        text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
        for m in re.finditer(r"^(?!static\b)((?:const\s+)?\w+(?:\s*\*)*)\s*\b(\w+)\s*\(([^)]*)\)\s*\{", text, re.M):
            params = [p.strip() for p in m.group(3).split(",") if p.strip() and p.strip() != "void"]
            types = [re.sub(r"\s*\b\w+$", "", p) if "*" not in p.rsplit(" ", 1)[-1] or p.endswith("*") else
                     p[:p.rindex("*") + 1] for p in params]
            found[m.group(2)] = (m.group(1).strip(), types)
    return found


def ctypes_kind(c_type: str):
    """What ctypes type may stand for a C type: a pointer any pointer type, a scalar its own."""
    c_type = c_type.replace("const ", "").strip()
    if c_type == "void":
        return None
    if "*" in c_type:
        return "pointer"
    return C_SCALARS[c_type]


def matches(kind, ctype) -> bool:
    if kind == "pointer":
        return ctype in (ctypes.c_void_p, ctypes.c_char_p) or (isinstance(ctype, type) and issubclass(ctype, ctypes._Pointer))
    return ctype is kind


def test_every_typed_function_matches_its_c_definition(kernels):
    definitions = c_definitions()
    typed = {name: fn for name, fn in vars(kernels).items() if isinstance(fn, ctypes._CFuncPtr)}
    assert len(typed) >= 20
    for attr, fn in typed.items():
        assert fn.__name__ in definitions, f"{attr}: no C definition of {fn.__name__}"
        ret, params = definitions[fn.__name__]
        assert len(fn.argtypes) == len(params), f"{fn.__name__}: {len(fn.argtypes)} argtypes, C takes {params}"
        for i, (ctype, c_type) in enumerate(zip(fn.argtypes, params)):
            assert matches(ctypes_kind(c_type), ctype), f"{fn.__name__} argument {i}: {ctype} for C's {c_type}"
        assert matches(ctypes_kind(ret), fn.restype) or (ctypes_kind(ret) is None and fn.restype is None), \
            f"{fn.__name__} returns {ret} in C, {fn.restype} in ctypes"


def test_the_definition_reader_reads_a_prototype():
    assert ctypes_kind("const float *") == "pointer" and ctypes_kind("int64_t") is ctypes.c_int64
    assert not matches(ctypes.c_int, ctypes.c_int64) and matches("pointer", ctypes.POINTER(ctypes.c_float))
