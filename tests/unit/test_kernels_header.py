"""hvdc_kernels.h is the one declaration of the C kernels: the ctypes
signatures of native.py and the enums of constants.py are held to it here,
by a small parser of the header (no compiler needed), and the built library
exports exactly the functions it declares."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest

from hvd_compress.kernels import constants, native, tf_native

HEADER = native.HEADER
SCALARS = {"i64": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float, "void": None}


def _strip(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def parse_enums(text):
    """``{enum name: {constant: value}}`` of every ``enum name { A = 0, ... };``."""
    out = {}
    for name, body in re.findall(r"\benum\s+(\w+)\s*\{([^}]*)\}\s*;", _strip(text)):
        members = {}
        for item in filter(None, (part.strip() for part in body.split(","))):
            const, _, value = (s.strip() for s in item.partition("="))
            assert value, f"enum {name}: give {const} its value explicitly"
            members[const] = int(value, 0)
        out[name] = members
    return out


def _ctype(decl, enums, where):
    """The ctypes type of a C type (with or without a parameter name)."""
    if "*" in decl:
        return ctypes.c_void_p
    words = [w for w in decl.split() if w != "const"]
    if words[:1] == ["enum"]:
        assert words[1] in enums, f"{where}: enum {words[1]} is not defined in the header"
        return ctypes.c_int
    assert words[0] in SCALARS, f"{where}: type {decl!r} is not one the parser knows ({', '.join(SCALARS)})"
    return SCALARS[words[0]]


def parse_prototypes(text):
    """``{function: (argument ctypes, return ctype)}`` of every ``hvdc_*`` prototype."""
    enums = parse_enums(text)
    body = re.sub(r"\benum\s+\w+\s*\{[^}]*\}\s*;", " ", _strip(text))
    out = {}
    for ret, name, params in re.findall(r"([A-Za-z_][\w\s\*]*?)\s*\b(hvdc_\w+)\s*\(([^)]*)\)\s*;", body):
        ret = ret.split(";")[-1].split("}")[-1].strip()
        args = tuple(_ctype(p.strip(), enums, name) for p in params.split(",") if p.strip() not in ("", "void"))
        assert name not in out, f"{name} is declared twice"
        out[name] = (args, _ctype(ret, enums, name))
    return out


def signature_drift(header_text, signatures):
    """Every difference between the header's prototypes and a ctypes table, as lines."""
    declared = parse_prototypes(header_text)
    lines = [f"{n}: declared in {HEADER.name}, missing from native.SIGNATURES" for n in declared.keys() - signatures.keys()]
    lines += [f"{n}: in native.SIGNATURES, not declared in {HEADER.name}" for n in signatures.keys() - declared.keys()]
    for name in sorted(declared.keys() & signatures.keys()):
        (want_args, want_res), (args, res) = declared[name], signatures[name]
        if tuple(args) != want_args or res != want_res:
            lines.append(f"{name}: header {want_args} -> {want_res}; native.py {tuple(args)} -> {res}")
    return lines


def members(cls):
    """``{name: value}`` of an enum class (aliases included) or of a class of int constants."""
    if hasattr(cls, "__members__"):
        return dict(cls.__members__)
    return {k: v for k, v in vars(cls).items() if k.isupper() and isinstance(v, int)}


def enum_drift(header_text, mirrored):
    """Every difference between the header's enums and their mirrors in constants.py, as lines."""
    enums = parse_enums(header_text)
    lines = [f"enum {n} has no mirror in constants.HEADER_ENUMS" for n in enums.keys() - mirrored.keys()]
    lines += [f"constants.HEADER_ENUMS names enum {n}, which the header lacks" for n in mirrored.keys() - enums.keys()]
    for name in sorted(enums.keys() & mirrored.keys()):
        cls, prefix = mirrored[name]
        python = {prefix + member: int(value) for member, value in members(cls).items()}
        if python != enums[name]:
            lines.append(f"enum {name}: header {enums[name]}; constants.{cls.__name__} {python}")
    return lines


def test_the_parser_reads_every_prototype_and_enum():
    text = HEADER.read_text()
    assert len(parse_prototypes(text)) == len(re.findall(r"\bhvdc_\w+\s*\(", _strip(text)))
    assert parse_prototypes(text)["hvdc_compensate_select"] == (
        (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int,
         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64), ctypes.c_int64)
    assert parse_enums(text)["hvdc_index_code"] == {"HVDC_CODE_RAW": 0, "HVDC_CODE_BITMAP": 1,
                                                    "HVDC_CODE_ELIAS_FANO": 2}


def test_native_signatures_are_the_headers():
    assert signature_drift(HEADER.read_text(), native.SIGNATURES) == []


def test_constants_mirror_the_headers_enums():
    assert enum_drift(HEADER.read_text(), constants.HEADER_ENUMS) == []


@pytest.mark.parametrize("old, new, says", [
    ("int hvdc_is_ascending(const i64 *idx, i64 k);", "int hvdc_is_ascending(const i64 *idx, int k);",
     "hvdc_is_ascending: header"),
    ("float hvdc_kth_largest(float *v, i64 m, i64 k);", "i64 hvdc_kth_largest(float *v, i64 m, i64 k);",
     "hvdc_kth_largest: header"),
    ("void hvdc_momentum(const float *x, float *u, i64 n, float m, int nesterov, float *d);",
     "void hvdc_momentum(const float *x, float *u, i64 n, float m, int nesterov, float *d, i64 extra);",
     "hvdc_momentum: header"),
    ("int hvdc_is_ascending(const i64 *idx, i64 k);", "", "hvdc_is_ascending: in native.SIGNATURES, not declared"),
    ("int hvdc_is_ascending(const i64 *idx, i64 k);",
     "int hvdc_is_ascending(const i64 *idx, i64 k);\nvoid hvdc_new_kernel(float *x, i64 n);",
     "hvdc_new_kernel: declared in"),
])
def test_a_drifted_signature_is_reported(old, new, says):
    """The check fails on a changed argument or return type, an argument more, a
    function dropped from the header or one added to it."""
    text = HEADER.read_text()
    assert old in text
    drift = signature_drift(text.replace(old, new), native.SIGNATURES)
    assert any(says in line for line in drift), drift


@pytest.mark.parametrize("old, new, says", [
    ("HVDC_CODE_ELIAS_FANO = 2", "HVDC_CODE_ELIAS_FANO = 3", "enum hvdc_index_code"),
    ("HVDC_SIGN_ONEBIT = 2 ", "HVDC_SIGN_ONEBIT = 2, HVDC_SIGN_TERNARY = 3 ", "enum hvdc_sign_mode"),
    ("enum hvdc_half_dtype {", "enum hvdc_half_format {", "enum hvdc_half_format has no mirror"),
])
def test_a_drifted_enum_is_reported(old, new, says):
    text = HEADER.read_text()
    assert old in text
    drift = enum_drift(text.replace(old, new), constants.HEADER_ENUMS)
    assert any(says in line for line in drift), drift


def test_the_sources_declare_nothing_of_their_own():
    """Both the C and the C++ file include the header, and neither declares an
    hvdc_ function the header does not (the compiler holds the definitions to
    the header's prototypes)."""
    c_source, ops = native.SOURCE.read_text(), tf_native.SOURCE.read_text()
    for text in (c_source, ops):
        assert '#include "hvdc_kernels.h"' in text
    assert 'extern "C"' not in ops
    declared = set(parse_prototypes(HEADER.read_text()))
    defined = set(re.findall(r"^(?:[\w\s\*]+?)\b(hvdc_\w+)\s*\([^;{]*\)\s*\{", _strip(c_source), flags=re.M))
    assert defined == declared


def test_the_library_exports_exactly_the_headers_functions():
    nm = shutil.which("nm")
    lib = native.load()
    assert lib is not None and nm is not None
    listed = subprocess.run([nm, "-D", "--defined-only", str(native.build())], capture_output=True, text=True,
                            check=True).stdout
    exported = {line.split()[-1] for line in listed.splitlines() if line.split()[-1].startswith("hvdc_")}
    assert exported == set(parse_prototypes(HEADER.read_text()))


@pytest.mark.parametrize("which", range(len(native.HEADERS)))
def test_a_changed_header_builds_its_own_library(tmp_path, monkeypatch, which):
    """The cache name hashes each header too (the declarations and the vector layer),
    for the C library and the TF op library."""
    cc = native.compiler()
    assert cc is not None
    c_before = native.library_path(cc)
    tf_before = tf_native.library_path(cc, cc, ((), (), "x"))
    headers = list(native.HEADERS)
    changed = tmp_path / headers[which].name
    changed.write_text(headers[which].read_text() + "\n/* changed */\n")
    headers[which] = changed
    monkeypatch.setattr(native, "HEADERS", tuple(headers))
    assert native.library_path(cc) != c_before
    assert tf_native.library_path(cc, cc, ((), (), "x")) != tf_before
