"""Anchored hooks applied to a COPY of a llama.cpp source tree: what every patch set shares.

A patch set (native/<set>/apply.py) is a list of Hooks, each a small edit at an exact
anchor in one file, plus whole new files copied next to llama.cpp's own. Anchors instead
of unified diffs: every anchor must match exactly once, so another llama.cpp version, or a
tree already patched, is refused by name (file, anchor, why) instead of half applied. Nothing
at all is written unless every anchor matched.

native/build.py hashes this file into the key of every patched flavor (patch_files), so a
change here rebuilds them all. Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

TARGET = "llama.cpp b11312 (0c1e57098)"  # the pinned source every anchor was read from


@dataclass(frozen=True)
class Hook:
    path: str
    anchor: str
    text: str
    where: str  # "before" or "after" the anchor, or "replace" it
    why: str


class PatchError(RuntimeError):
    """The set does not apply to this tree; the message names the file and the anchor."""


@dataclass(frozen=True)
class PatchSet:
    name: str  # for messages: "turboquant patch set"
    mark: str  # every edit carries it; a file holding it is already patched
    hooks: tuple[Hook, ...]
    here: Path  # the set's directory, where its new files are
    new_files: tuple[tuple[str, str], ...] = ()  # (file in `here`, destination in the tree)
    requires: tuple[str, ...] = ("include/llama.h",)  # what makes a tree llama.cpp's

    def plan(self, src: Path, over: dict[Path, str] | None = None) -> dict[Path, str]:
        """Every edited file's new text, in memory; PatchError on any problem. `over`: texts
        that stand for files of `src` (earlier sets' plans, for a set applied after them)."""
        if not all((src / r).is_file() for r in self.requires):
            raise PatchError(f"{src} is not a llama.cpp source tree (no {', '.join(self.requires)})")
        for _, dest in self.new_files:
            if (src / dest).exists():
                raise PatchError(f"{dest} already exists in {src}: already patched, or a newer llama.cpp "
                                 "with its own file of that name; refusing to overwrite")
        texts: dict[Path, str] = {}
        for hook in self.hooks:
            path = src / hook.path
            if path not in texts:
                if not path.is_file() and not (over and path in over):
                    raise PatchError(f"{hook.path}: file not found ({hook.why})")
                texts[path] = over[path] if over and path in over else path.read_text()
                if self.mark in texts[path]:
                    raise PatchError(f"{hook.path} already carries the {self.mark} patch")
            text = texts[path]
            count = text.count(hook.anchor)
            if count != 1:
                raise PatchError(
                    f"{hook.path}: anchor for '{hook.why}' matches {count} times (need exactly 1). "
                    f"This patch set targets {TARGET}; anchor was:\n{hook.anchor}")
            if hook.where == "before":
                new = hook.text + hook.anchor
            elif hook.where == "after":
                new = hook.anchor + hook.text
            elif hook.where == "replace":
                new = hook.text
            else:
                raise AssertionError(hook.where)
            texts[path] = text.replace(hook.anchor, new, 1)
        return texts

    def apply(self, src: Path) -> None:
        texts = self.plan(src)  # nothing is written unless every anchor matched
        for name, dest in self.new_files:
            shutil.copyfile(self.here / name, src / dest)
        for path, text in texts.items():
            path.write_text(text)

    def main(self, argv: list[str], usage: str) -> int:
        """`python3 native/<set>/apply.py <llama.cpp-source-dir>`: 0 applied, 1 refused, 2 usage."""
        if len(argv) != 1:
            print(usage, file=sys.stderr)
            return 2
        src = Path(argv[0]).resolve()
        try:
            self.apply(src)
        except PatchError as e:
            print(f"{self.name}: {e}", file=sys.stderr)
            return 1
        print(f"{self.name} applied to {src}: {len(self.new_files)} new files, {len(self.hooks)} hooks")
        return 0
