"""JSON-schema corpora: a directory of schema files, or one that ships in an installed package.

Nothing is fetched: a corpus is what is on disk.

- a directory: every ``*.json`` under it (recursively) that holds a JSON object, named by
  its path relative to the directory;
- ``check-jsonschema``: the CI and configuration schemas that package vendors
  (``check_jsonschema/builtin_schemas/vendor``), named by file;
- ``schemastore``: the SchemaStore catalog cached inside the ``schemastore`` package (a
  requests-cache SQLite file, read as it is, never refreshed), each schema named as the
  catalog names it;
- any other installed package: the ``*.json`` files under it that look like schemas (a
  ``$schema`` key).

`load` returns them sorted by name, so a fixed subset (`pick`) is the same on every machine
with the same package versions; `versions` says which.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Schema", "load", "pick", "versions", "PACKAGES", "check_spec"]

#: Package names with a corpus of their own, and the distribution that ships it.
PACKAGES = {"check-jsonschema": "check-jsonschema", "check_jsonschema": "check-jsonschema",
            "schemastore": "schemastore"}


@dataclass(frozen=True)
class Schema:
    name: str
    schema: Any
    size: int  # bytes of its JSON text


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {module!r} is not installed (pip install it: see pyproject's dev extra)")
    return Path(next(iter(spec.submodule_search_locations)))


def _from_files(files: list[Path], root: Path, want_schema_key: bool = False) -> list[Schema]:
    out = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
            value = json.loads(text)
        except (OSError, ValueError):
            continue
        if isinstance(value, dict) and (not want_schema_key or "$schema" in value):
            out.append(Schema(str(f.relative_to(root)), value, len(text.encode())))
    return out


def _schemastore() -> list[Schema]:
    import requests_cache  # schemastore's own dependency

    path = _package_dir("schemastore") / "cache.sqlite"
    if not path.exists():
        raise FileNotFoundError(f"{path}: schemastore's cached catalog is missing")
    cache = requests_cache.SQLiteCache(str(path))
    bodies: dict[str, bytes] = {}
    for resp in cache.responses.values():
        bodies[resp.url] = resp.content
    catalog_url = next((u for u in bodies if u.endswith("src/api/json/catalog.json")), None)
    names: dict[str, str] = {}
    if catalog_url is not None:
        for entry in json.loads(bodies[catalog_url]).get("schemas", []):
            if isinstance(entry, dict) and isinstance(entry.get("url"), str):
                names.setdefault(entry["url"], str(entry.get("name") or entry["url"]))
    out = []
    for url, body in bodies.items():
        if url.endswith("catalog.json"):
            continue
        try:
            value = json.loads(body)
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(Schema(names.get(url, url), value, len(body)))
    return out


def check_spec(spec: str) -> None:
    """FileNotFoundError unless `spec` is a directory or an installed package (what `load`
    reads, checked without reading it)."""
    if Path(spec).is_dir():
        return
    _package_dir({"schemastore": "schemastore", "check-jsonschema": "check_jsonschema"}.get(
        PACKAGES.get(spec, ""), spec.replace("-", "_")))


def load(spec: str) -> list[Schema]:
    """The corpus `spec` names (a directory or a package), sorted by name."""
    path = Path(spec)
    if path.is_dir():
        out = _from_files(sorted(path.rglob("*.json")), path)
    elif PACKAGES.get(spec) == "schemastore":
        out = _schemastore()
    elif PACKAGES.get(spec) == "check-jsonschema":
        root = _package_dir("check_jsonschema") / "builtin_schemas" / "vendor"
        out = _from_files(sorted(root.glob("*.json")), root)
    else:
        root = _package_dir(spec.replace("-", "_"))
        out = _from_files(sorted(root.rglob("*.json")), root, want_schema_key=True)
    if not out:
        raise FileNotFoundError(f"{spec}: no JSON schema found")
    return sorted(out, key=lambda s: s.name)


def pick(corpus: list[Schema], limit: int | None, max_bytes: int | None = None) -> list[Schema]:
    """A fixed subset: the schemas up to `max_bytes`, then every k-th so that `limit` are
    spread over the sorted corpus (all of them without a limit)."""
    pool = [s for s in corpus if max_bytes is None or s.size <= max_bytes]
    if limit is None or limit >= len(pool):
        return pool
    step = len(pool) / limit
    return [pool[int(i * step)] for i in range(limit)]


def versions(spec: str) -> dict[str, str]:
    """The version of the package a corpus comes from (empty for a directory)."""
    dist = PACKAGES.get(spec, spec)
    if Path(spec).is_dir():
        return {}
    try:
        return {dist: importlib.metadata.version(dist)}
    except importlib.metadata.PackageNotFoundError:
        return {}
