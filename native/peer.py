#!/usr/bin/env python3
"""Build llama-server, the peer `clickpaca bench peer` compares against, cheaply.

Why not a build of its own: a second full build of the pinned source costs ~10 minutes
of every core. llama-server only needs the mainline build tree plus a few targets
(server-context, mtmd, cpp-httplib, the UI stub), so this step takes the finished
mainline tree (same source, preset and flags), turns the server on in it, builds only
the llama-server target, and turns the server off again so the tree keeps its preset's
configuration. Nothing is downloaded: the web UI is neither built (npm) nor fetched
(LLAMA_USE_PREBUILT_UI=OFF); the server runs without one.

    python3 native/peer.py [--preset linux-cpu]

Result: builds/peer -> $CLICKPACA_CACHE/builds/peer-<preset>-<key>/ with bin/llama-server
and lib/ (its shared libraries), keyed by the mainline key and the server options. The
`.complete` marker is written last: a failed or interrupted run leaves nothing a later
run takes as finished. Standard library only, like build.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build  # noqa: E402  (native/build.py: the cache, its lock and the mainline build)

# The server on, its web UI off and never downloaded (tools/ui, scripts/ui-assets.cmake).
SERVER_OPTIONS = {"LLAMA_BUILD_SERVER": "ON", "LLAMA_BUILD_UI": "OFF",
                  "LLAMA_USE_PREBUILT_UI": "OFF"}
TARGET = "llama-server"


def cache_values(cmake_dir: Path, names: list[str]) -> dict[str, str]:
    """Current values of some CMakeCache.txt entries (to restore them afterwards)."""
    text = (cmake_dir / "CMakeCache.txt").read_text()
    out = {}
    for name in names:
        m = re.search(rf"^{re.escape(name)}:[A-Z]+=(.*)$", text, re.M)
        if m:
            out[name] = m.group(1)
    return out


def check_source_dir(cmake_dir: Path) -> None:
    """Reconfiguring reads the wrapper CMakeLists.txt of the checkout that configured the
    tree; it must be the same file this checkout keys its builds by."""
    text = (cmake_dir / "CMakeCache.txt").read_text()
    m = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", text, re.M)
    home = Path(m.group(1)) if m else None
    ours = (build.ROOT / "CMakeLists.txt").read_bytes()
    if home is None or not (home / "CMakeLists.txt").exists() \
            or (home / "CMakeLists.txt").read_bytes() != ours:
        raise build.BuildError(
            f"the mainline tree {cmake_dir} was configured from {home}, whose CMakeLists.txt "
            "is missing or differs from this checkout's; run `make mainline` from a checkout "
            "with the same CMakeLists.txt")


def build_peer(preset: str, jobs: int, tools: list[str] | None = None, flavor: str = "mainline") -> Path:
    """`tools`: the mainline build's tools when not all of them (build.py --only-tools): the
    peer is built in that mainline tree, keyed by it. `flavor` patched: in the patched tree
    instead (a GPU pack compiles one CUDA tree: its patches are inert unless asked for),
    linked as builds/peer-patched so the CPU default's builds/peer stays."""
    # The flavour's lock: llama-server is built inside its tree.
    with build.cache_lock(flavor, preset):
        main = build.build_locked(flavor, preset, None, jobs, only_tools=tools)
        main_key = (main / ".complete").read_text().strip()
        key = hashlib.sha256(json.dumps({"mainline": main_key, "target": TARGET,
                                         "options": SERVER_OPTIONS}, sort_keys=True)
                             .encode()).hexdigest()[:16]
        out = build.cache_dir() / "builds" / f"peer-{preset}-{key}"
        if (out / ".complete").exists():
            build.log(f"peer: cached build {out} (key {key})")
        else:
            make_peer(main, out, key, main_key, jobs)
    build.link_build("peer" if flavor == "mainline" else f"peer-{flavor}", out)
    return out


def make_peer(main: Path, out: Path, key: str, main_key: str, jobs: int) -> None:
    t0 = time.monotonic()
    cmake_dir = main / "cmake"
    check_source_dir(cmake_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    logfile = out / "build.log"
    env = dict(os.environ)
    main_info = json.loads((main / "build-info.json").read_text())
    toolkit = (main_info.get("cuda") or {}).get("root")
    if toolkit:
        build.link_driver_stub(env, Path(toolkit), out)
    before = cache_values(cmake_dir, list(SERVER_OPTIONS))
    on = [f"-D{k}={v}" for k, v in SERVER_OPTIONS.items()]
    build.log(f"peer: building {TARGET} in the tree {cmake_dir}")
    try:
        build.run_streamed(["cmake", str(cmake_dir), *on], env, logfile)
        build.run_streamed(["cmake", "--build", str(cmake_dir), "-j", str(jobs),
                            "--target", TARGET], env, logfile)
    finally:
        # Back to the preset's configuration (the server's objects stay for the next run).
        build.run_streamed(["cmake", str(cmake_dir), *[f"-D{k}={v}" for k, v in before.items()]],
                           env, logfile)
    cbin = cmake_dir / "bin"
    # The server must run on the very library clickpaca loads: turning the server on may
    # not have rebuilt it.
    want = main_info["libllama_sha256"]
    got = build.sha256_file(cbin / "libllama.so")
    if got != want:
        raise build.BuildError(f"building {TARGET} changed libllama.so in {cbin} "
                               f"(sha256 {got}, mainline {want}); not using it")
    (out / "bin").mkdir()
    (out / "lib").mkdir()
    for so in sorted(cbin.glob("*.so*")):
        if so.is_symlink():
            os.symlink(os.readlink(so), out / "lib" / so.name)
        else:
            build.link_or_copy(so, out / "lib" / so.name)
    # The run path $ORIGIN/../lib (CMakeLists.txt) finds lib/ from bin/.
    shutil.copy2(cbin / TARGET, out / "bin" / TARGET)
    info = {"flavor": "peer", "target": TARGET, "key": key, "mainline_key": main_key,
            "libllama_sha256": got,
            "mainline": str(main), "options": SERVER_OPTIONS,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(time.monotonic() - t0, 1)}
    (out / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / ".complete").write_text(key + "\n")
    build.log(f"peer: built in {info['build_seconds']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=os.environ.get("PRESET", "linux-cpu"))
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--only-tools", default=os.environ.get("ONLY_TOOLS"),
                    help="the mainline build to build in: the one with these tools (build.py --only-tools)")
    ap.add_argument("--flavor", default="mainline", choices=["mainline", "patched"],
                    help="the tree to build it in (patched: linked as builds/peer-patched)")
    args = ap.parse_args(argv)
    try:
        build_peer(args.preset, args.jobs, build.selected_tools(args.only_tools), args.flavor)
    except build.BuildError as e:
        build.log(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
