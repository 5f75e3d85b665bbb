"""Layout proof: the C compiler's sizeof/offsetof of every record against cffi's.

ABI mode trusts the declarations. A struct can keep its size while its fields move
(two fields swapped, one field replaced by another of the same size), and then every
access through the bindings silently reads the wrong member. A size check misses that;
comparing the offset of every field does not.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any


class LayoutError(RuntimeError):
    """cffi's layout of some record differs from the compiler's."""


def probe_source(headers: list[str], records: dict[str, dict[str, Any]]) -> str:
    lines = ["#include <stdio.h>", "#include <stddef.h>"]
    lines += [f'#include "{h}"' for h in headers]
    lines.append("int main(void) {")
    for name, rec in records.items():
        lines.append(f'    printf("S\\t{name}\\t%zu\\n", sizeof({name}));')
        for f in rec["fields"]:
            if "bits" in f or not f["name"]:
                continue  # offsetof is not defined for bit-fields
            lines.append(f'    printf("F\\t{name}\\t{f["name"]}\\t%zu\\n", offsetof({name}, {f["name"]}));')
    lines.append("    return 0;\n}")
    return "\n".join(lines) + "\n"


def compiler_layout(headers: list[str], include_dirs: list[Path],
                    records: dict[str, dict[str, Any]], cc: str | None = None) -> dict:
    """Compile and run the probe; return {record: {"size": n, "fields": {name: offset}}}."""
    cc = cc or os.environ.get("CC", "gcc")
    with tempfile.TemporaryDirectory(prefix="clickpaca-layout-") as tmp:
        src = Path(tmp) / "probe.c"
        exe = Path(tmp) / "probe"
        src.write_text(probe_source(headers, records))
        cmd = [cc, "-std=c11", "-o", str(exe), str(src)]
        for d in include_dirs:
            cmd += ["-I", str(d)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise LayoutError(f"the layout probe does not compile:\n{proc.stderr[-3000:]}")
        run = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    out: dict[str, dict[str, Any]] = {}
    for line in run.stdout.splitlines():
        parts = line.split("\t")
        if parts[0] == "S":
            out.setdefault(parts[1], {"fields": {}})["size"] = int(parts[2])
        elif parts[0] == "F":
            out.setdefault(parts[1], {"fields": {}})["fields"][parts[2]] = int(parts[3])
    return out


def compare(cffi_records: dict[str, dict[str, Any]], c_records: dict[str, dict]) -> list[str]:
    """Every difference, one precise line each; empty when the layouts agree."""
    problems = []
    for name, rec in cffi_records.items():
        c = c_records.get(name)
        if c is None:
            problems.append(f"{name}: the compiler probe did not report it")
            continue
        if c["size"] != rec["size"]:
            problems.append(f"{name}: sizeof is {c['size']} in C but {rec['size']} in cffi")
        for f in rec["fields"]:
            if "bits" in f or not f["name"]:
                continue
            off = c["fields"].get(f["name"])
            if off != f["offset"]:
                problems.append(f"{name}.{f['name']}: offset {off} in C but {f['offset']} in cffi")
    return problems


def prove(cffi_records: dict[str, dict[str, Any]], headers: list[str],
          include_dirs: list[Path]) -> int:
    """Raise LayoutError listing every mismatch; return the number of fields checked."""
    c_records = compiler_layout(headers, include_dirs, cffi_records)
    problems = compare(cffi_records, c_records)
    if problems:
        raise LayoutError("cffi's layout differs from the compiler's:\n  " + "\n  ".join(problems))
    return sum(len(r["fields"]) for r in cffi_records.values())
