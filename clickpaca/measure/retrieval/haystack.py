"""Needles and haystacks: facts with a unique answer, placed at depths of a filler text.

Three kinds of needle, as in needle-in-a-haystack studies: a pass key (five digits), a
name (first and last) and a number (three or four digits), each about its own subject so
that every question has exactly one answer in the haystack. The facts are generated from
a seed (the same seed, the same needles); nothing here reads a model: the command
tokenizes the sentences and hands token arrays to `assemble`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SUBJECTS = ("blue door", "copper gate", "north tower", "old chest", "silver box", "east cellar",
            "iron vault", "garden shed", "stone well", "red wagon", "west mill", "oak cabinet",
            "glass jar", "long barn", "tin trunk", "south bridge")
FIRST = ("Miriam", "Tobias", "Elena", "Casimir", "Ingrid", "Rafael", "Odette", "Lucian",
         "Beatrix", "Anselm", "Petra", "Dorian")
LAST = ("Castell", "Whitlow", "Brandt", "Okafor", "Lindqvist", "Marchetti", "Haldane",
        "Vasquez", "Ferrant", "Nakamura", "Ostrowski", "Pellegrin")
KINDS = ("passkey", "name", "number")


@dataclass(frozen=True)
class Needle:
    """One fact, its question (ending where the answer starts) and the answer."""

    kind: str
    subject: str
    answer: str  # the expected continuation, with its leading space
    fact: str  # the sentence placed in the haystack
    question: str  # asked after the haystack; the model continues it with the answer


def make_needles(n: int, seed: int = 0) -> list[Needle]:
    """n needles, kinds in turn, distinct subjects (at most len(SUBJECTS))."""
    if not 1 <= n <= len(SUBJECTS):
        raise ValueError(f"needles: must be 1 to {len(SUBJECTS)}, got {n}")
    rng = np.random.default_rng(seed)
    subjects = [SUBJECTS[i] for i in rng.permutation(len(SUBJECTS))[:n]]
    out = []
    for i, subj in enumerate(subjects):
        kind = KINDS[i % len(KINDS)]
        if kind == "passkey":
            ans = str(int(rng.integers(10000, 100000)))
            fact = f"The pass key to the {subj} is {ans}."
            q = f"What is the pass key to the {subj}? The pass key to the {subj} is"
        elif kind == "name":
            ans = f"{FIRST[int(rng.integers(len(FIRST)))]} {LAST[int(rng.integers(len(LAST)))]}"
            fact = f"The keeper of the {subj} is called {ans}."
            q = f"Who keeps the {subj}? The keeper of the {subj} is called"
        else:
            ans = str(int(rng.integers(100, 10000)))
            fact = f"The {subj} holds exactly {ans} coins."
            q = f"How many coins does the {subj} hold? The {subj} holds exactly"
        out.append(Needle(kind, subj, " " + ans, fact, q))
    return out


def depths(n: int) -> list[float]:
    """n depths spread evenly over the haystack, away from both ends: (i + 0.5) / n."""
    return [(i + 0.5) / n for i in range(n)]


def assemble(filler: np.ndarray, breaks: np.ndarray, needles: list[np.ndarray], where: list[float],
             length: int) -> tuple[np.ndarray, list[int]]:
    """(haystack of exactly `length` tokens, start of each needle in it).

    filler: the text's tokens (BOS first if the model uses one); breaks: True where a
    filler token ends a line. Needle i goes after the line break of the filler nearest to
    depth where[i] of the haystack, so a needle never splits a line of the text; the
    filler is cut so that filler and needles make `length` tokens. No needles: the
    filler alone (the needle-removed control, same length)."""
    filler = np.asarray(filler, dtype=np.int32)
    breaks = np.asarray(breaks, dtype=bool)
    if len(breaks) != len(filler):
        raise ValueError("breaks and filler differ in length")
    if len(needles) != len(where):
        raise ValueError("one depth per needle")
    n_fill = length - sum(len(x) for x in needles)
    if n_fill < 2 or len(filler) < n_fill:
        raise ValueError(f"length {length}: the filler has {len(filler)} tokens, {n_fill} needed")
    line_ends = np.flatnonzero(breaks[:n_fill]) + 1  # cut points after a line break
    cuts = []
    for d in where:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"depth {d} outside 0..1")
        target = max(1, int(round(d * n_fill)))  # never before BOS
        if len(line_ends):
            target = int(line_ends[np.argmin(np.abs(line_ends - target))])
        cuts.append(min(target, n_fill))
    order = np.argsort(cuts, kind="stable")
    parts, starts, pos, prev = [], [0] * len(needles), 0, 0
    for i in order:
        parts.append(filler[prev:cuts[i]])
        pos += cuts[i] - prev
        starts[i] = pos
        parts.append(np.asarray(needles[i], dtype=np.int32))
        pos += len(needles[i])
        prev = cuts[i]
    parts.append(filler[prev:n_fill])
    out = np.concatenate(parts) if parts else filler[:n_fill].copy()
    assert len(out) == length
    return out, starts
