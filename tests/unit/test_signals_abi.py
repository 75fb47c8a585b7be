"""bpf/sensor.c and its Python mirror (agent/signals/abi.py) must agree field by field."""

from __future__ import annotations

import ctypes as ct
import re

from agent.signals import abi

C_TYPES = {"u8": ct.c_uint8, "u16": ct.c_uint16, "u32": ct.c_uint32, "u64": ct.c_uint64, "char": ct.c_char}


def _c_source() -> str:
    with open(abi.SOURCE) as f:
        return f.read()


def _c_structs(text: str) -> dict[str, list[tuple[str, str, str]]]:
    out = {}
    for m in re.finditer(r"^struct (\w+) \{\n(.*?)\n\};", text, re.S | re.M):
        fields = []
        for line in m.group(2).splitlines():
            line = line.strip()
            if not line or line.startswith("//"):
                continue
            fm = re.match(r"(\w+) (\w+)(?:\[([^\]]+)\])?;", line)
            assert fm, line
            fields.append(fm.groups())
        out[m.group(1)] = fields
    return out


def _defines(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#define (\w+) ([^\n/]+?)\s*(?://.*)?$", text, re.M))


def test_every_shared_struct_is_mirrored_field_by_field():
    text = _c_source()
    structs = _c_structs(text)
    defines = _defines(text)
    assert set(abi.MIRRORS) <= set(structs)
    for name, mirror in abi.MIRRORS.items():
        c_fields = structs[name]
        assert [f[0] for f in mirror._fields_] == [f[1] for f in c_fields], name
        for (fname, ftype), (ctype, _cname, dim) in zip(mirror._fields_, c_fields):
            base = C_TYPES[ctype]
            if dim:
                n = eval(re.sub(r"[A-Z_]+", lambda m: defines[m.group(0)], dim))  # noqa: S307 (our own source)
                assert ftype._length_ == n and ftype._type_ is base, (name, fname)
            else:
                assert ftype is base, (name, fname)


def test_constants_agree():
    d = _defines(_c_source())
    for name in ("EV_EXEC", "EV_CONN", "FNAME_LEN", "ARG_LEN", "ARGS_BUF", "MAX_ARGS", "EXEC_ARGV_TRUNCATED",
                 "EXEC_ARGV_MISSING", "MAX_SLOTS", "MAX_TRACKED", "MAX_SOCKS", "MAX_EPS"):
        assert int(d[name]) == getattr(abi, name), name
    assert int(d["STREAK_SLACK_NS"].rstrip("UL")) == abi.STREAK_SLACK_NS  # noqa: B005 (C suffix letters)
    assert int(d["STREAK_DEFAULT_GAP_NS"].rstrip("UL")) == abi.STREAK_DEFAULT_GAP_NS  # noqa: B005


def test_every_tracepoint_has_a_probe():
    text = _c_source()
    probes = set(re.findall(r"TRACEPOINT_PROBE\((\w+), (\w+)\)", text))
    assert {tuple(tp.split(":")) for tp in abi.TRACEPOINTS} == probes


def test_fields_read_by_each_probe_are_declared_for_bpf_check():
    """bpf check and the loader's flags rely on abi.TRACEPOINTS listing every field a
    probe reads; a field used but not declared would break on kernels without it."""
    text = _c_source()
    bodies = re.findall(r"TRACEPOINT_PROBE\((\w+), (\w+)\) \{(.*?)\n\}", text, re.S)
    assert len(bodies) == len(abi.TRACEPOINTS)
    helpers = dict(re.findall(r"static __always_inline \w+ \*?(\w+)\((.*?)\n\}", text, re.S))
    for cat, name, body in bodies:
        used = set(re.findall(r"args->(\w+)", body)) | set(re.findall(r"TP_DATA_LOC_READ_STR\([^,]+, (\w+),", body))
        spec = abi.TRACEPOINTS[f"{cat}:{name}"]
        declared = set(spec["required"]) | {f for fs in spec.get("optional", {}).values() for f in fs}
        assert used <= declared, (cat, name, used - declared)
        assert set(spec["required"]) <= used, (cat, name, set(spec["required"]) - used)
    assert "args->" not in "".join(helpers.values())  # helpers get values, never the args struct
