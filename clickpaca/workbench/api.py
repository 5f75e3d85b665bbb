"""`Workbench`: experiments in a few lines over one server, with typed results.

    from clickpaca import Workbench
    with Workbench.spawn(nCtx=4096, nSeqMax=16) as wb:
        gens = wb.generate(["The capital of France is", "Once upon a time"], maxTokens=8, temperature=0)
        print(gens[0].text, gens.to_records())
        doc = wb.prefill(open("doc.txt").read())
        answers = doc.generate(["Question: ...\\nAnswer:"], maxTokens=16)
        nll = wb.score(["Some text to score."])

Requests take the protocol's own field names (docs/PROTOCOL.md: `maxTokens`,
`temperature`, `samplers`, ...); the server validates them, so a bad value ends that
request as a Generation with its error and the others go on. Two conveniences are
resolved here: `grammar=` (GBNF, `%llguidance` or `%json_schema` text) and
`json_schema=` (a dict) are registered once per server and sent as `grammar_id`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from typing import Any, Iterable, Sequence

import numpy as np
import orjson

from ..wire.client import ServerError, default_python
from . import patching
from .lens import LensTable, draw as draw_lens, table as lens_table
from .progress import Progress
from .results import Generation, Results, Score
from .schedule import EventClient, Slots, gone, run_jobs
from .sweep import SweepResult, run_sweep

#: An item of `generate`: a prompt, a conversation (list of messages), or a dict with
#: `prompt` or `messages` and its own steering (overriding the call's; `label` names it).
Item = str | list[dict[str, str]] | dict[str, Any]


class Workbench:
    """One server (spawned on stdio, or attached to a socket) and its slots."""

    def __init__(self, client: EventClient, ready: dict[str, Any], slots: int | None = None) -> None:
        self.client, self.ready = client, ready
        n = int(ready.get("nSeqMax") or 1) if slots is None else int(slots)
        self.slots = Slots(list(range(n)))
        self.n_slots = n
        self._grammars: dict[str, str] = {}

    # ------------------------------------------------------------ construction

    @classmethod
    def spawn(cls, *serve_args: str, steps: Sequence[str | os.PathLike] = (), env: dict | None = None,
              stderr: Any = None, python: str | None = None, **init: Any) -> "Workbench":
        """Start `clickpaca serve ARGS` on stdio and initialise it with `init` (protocol
        `init` fields: nCtx, nSeqMax, cacheTypeK, build, deterministic, modelPath, ...).
        steps: files or modules of user-defined sampler steps (`serve --steps`)."""
        env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "passive"), **(env or {})}
        serve_args = (*serve_args, *(a for s in steps for a in ("--steps", str(s))))
        client = EventClient.spawn(*serve_args, env=env, stderr=stderr, python=python or default_python())
        try:
            ready = client.init(**{k: v for k, v in init.items() if v is not None})
        except BaseException:
            client.close()
            raise
        return cls(client, ready)

    @classmethod
    def connect(cls, path: str | os.PathLike, slots: int | None = None) -> "Workbench":
        """Attach to a running `clickpaca serve --socket PATH` (initialised at its start).
        `slots`: seq_ids this client may use (default nSeqMax; a server started with
        --max-seqs-per-client allows fewer)."""
        client = EventClient.connect(path)
        try:
            ready = client.init()
        except BaseException:
            client.close()
            raise
        return cls(client, ready, slots)

    def close(self) -> int | None:
        """Let running requests finish, stop the server (if spawned) and return its status."""
        try:
            self.client.quit()
        except OSError:
            pass
        return self.client.close()

    def __enter__(self) -> "Workbench":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ generation

    def generate(self, items: Item | Sequence[Item], progress: bool | None = None,
                 concurrency: int | None = None, **steering: Any) -> Results[Generation]:
        """One Generation per item, in input order, scheduled over every free slot
        (at most `concurrency` at once, when given)."""
        items = [items] if isinstance(items, (str, dict)) else list(items)
        jobs, labels = [], []
        for item in items:
            req, label = self._infer_request(item, steering)
            jobs.append(req)
            labels.append(label)
        out: list[Generation | None] = [None] * len(jobs)
        with Progress(len(jobs), "generate", progress) as bar:
            def done(i: int, events: list[dict], t_sent: float) -> None:
                out[i] = Generation.from_events(i, jobs[i], events, t_sent, labels[i])
                bar.update(out[i])

            run_jobs(self.client, self.slots, jobs, done, concurrency)
        return Results(out)

    async def agenerate(self, items: Item | Sequence[Item], progress: bool | None = None,
                        concurrency: int | None = None, **steering: Any) -> Results[Generation]:
        """`generate` for asyncio: the scheduling runs on a worker thread, so the event loop
        stays free; concurrent calls share the server's slots."""
        return await asyncio.to_thread(self.generate, items, progress, concurrency, **steering)

    def score(self, texts: str | Iterable[str], window: int | None = None,
              progress: bool | None = None) -> Results[Score]:
        """Per-token negative log-likelihood of each text (the server's `score`)."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        extra = {"window": window} if window is not None else {}
        jobs = [{"type": "score", "text": t, "perToken": True, **extra} for t in texts]
        out: list[Score | None] = [None] * len(jobs)
        with Progress(len(jobs), "score", progress) as bar:
            def done(i: int, events: list[dict], t_sent: float) -> None:
                out[i] = Score.from_events(i, texts[i], events, t_sent)
                bar.update(out[i])

            run_jobs(self.client, self.slots, jobs, done)
        return Results(out)

    def lens(self, prompt: Item, layers: list[int] | str = "all", top: int = 5, plot: bool | str = True,
             **steering: Any) -> "LensTable":
        """The logit lens of one generation (the server's `lens`; docs/ACTIVATIONS.md): a
        tidy table, one row per generated token, layer and rank (token, layer, rank,
        token_text, logprob, ...). `plot`: draw the layers x tokens picture (True), save it
        to a path (a string), or not (False); it is the table's `figure`."""
        req, _ = self._infer_request(prompt, {**steering, "lens": {"layers": layers, "top": top}})
        got: list[list[dict]] = []
        run_jobs(self.client, self.slots, [req], lambda i, events, t: got.append(events), None)
        events = got[0]
        if events and events[-1].get("type") == "error":
            raise ServerError(events[-1])
        t = lens_table(events)
        if plot:
            t.figure = draw_lens(t, plot if isinstance(plot, str) else None)
        return t

    # ------------------------------------------------------------ held documents

    def prefill(self, text: str | None = None, messages: list[dict] | None = None,
                **params: Any) -> "Document":
        """Process a document once and hold it on a slot of its own (until `free`)."""
        sid = self.slots.take_wait(self.client.closed)
        req: dict[str, Any] = {"type": "prefill", "seq_id": sid}
        req.update({"prompt": text} if messages is None else {"messages": messages})
        req.update(params)
        try:
            ans = self.client.request(req)
        except BaseException:
            self.slots.give(sid)
            raise
        return Document(self, sid, ans)

    # ------------------------------------------------------------ activation patching

    def activations(self, prompt: str, nodes: Sequence[str]) -> dict[str, np.ndarray]:
        """node -> the prompt's rows at every position (float32 [tokens, ...]): a prefill
        with `capture` (captureTokens all), its slot freed (workbench/patching.py)."""
        sid = self.slots.take_wait(self.client.closed)
        try:
            ev = self.client.request({"type": "prefill", "seq_id": sid, "prompt": prompt, "capture": list(nodes),
                                      "captureTokens": "all"})
            self.client.request({"type": "free", "seq_id": sid})
        finally:
            self.slots.give(sid)
        return patching.rows_of(ev)

    def patch(self, items: Item | Sequence[Item], patches: Sequence[Any], progress: bool | None = None,
              **steering: Any) -> Results[Generation]:
        """`generate` with activation patching: `patches` one list of entries `{node,
        positions, source, mode}` for every item, or one list per item; a numpy `source`
        is sent inline (workbench/patching.py). Needs the activations build."""
        items = [items] if isinstance(items, (str, dict)) else list(items)
        each = patching.per_item(patches, len(items))
        bodies = [{**(it if isinstance(it, dict) else {"messages": it} if isinstance(it, list) else {"prompt": it}),
                   **({"patch": p} if p else {})} for it, p in zip(items, each)]  # [] : no patch
        return self.generate(bodies, progress=progress, **steering)

    # ------------------------------------------------------------ sweeps

    @classmethod
    def sweep(cls, configs: Any, prompts: Sequence[Item], init: dict[str, Any] | None = None,
              record: bool = True, progress: bool | None = None, steps: Sequence[str | os.PathLike] = (),
              **steering: Any) -> "SweepResult":
        """The same prompts under several server configs, one server each, paired per
        prompt against the first and recorded in the results store (workbench/sweep.py).
        configs: cache type strings ("q8_0", "q8_0/q4_0"), dicts of init fields, or a
        dict of label -> either; init: fields every server gets (nCtx, nSeqMax, ...);
        steps: user-defined steps every server loads (`serve --steps`)."""
        return run_sweep(cls.spawn, configs, prompts, init=init, record=record, progress=progress, steps=steps,
                         **steering)

    # ------------------------------------------------------------ helpers

    def _infer_request(self, item: Item, steering: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        if isinstance(item, str):
            body: dict[str, Any] = {"prompt": item}
        elif isinstance(item, dict):
            body = dict(item)
        elif isinstance(item, list):
            body = {"messages": item}
        else:
            raise TypeError(f"a generate item is a prompt, a list of messages or a dict, not {type(item).__name__}")
        params = {**steering, **body}
        label = params.pop("label", None)
        return {"type": "infer", **self._resolve(params)}, label

    def _resolve(self, params: dict[str, Any]) -> dict[str, Any]:
        """`grammar=` / `json_schema=` -> a registered grammar_id."""
        text = params.pop("grammar", None)
        schema = params.pop("json_schema", None)
        if schema is not None:
            if text is not None:
                raise ValueError("give grammar or json_schema, not both")
            text = "%json_schema " + json.dumps(schema, sort_keys=True)
        if text is not None:
            params["grammar_id"] = self.grammar(text)
        return params

    def vector(self, vid: str, vector: Any) -> dict[str, Any]:
        """Register a steering vector under `vid` (the activations build): a control-vector
        GGUF path (read here, sent as data), or {layer: array or list}; its `vector_ready`
        (slot, layers, norms).
        Requests name it in `steer=[{"vector": vid, "strength": s, ...}]` (docs/PROTOCOL.md)."""
        from ..activations.capture import encode
        from ..activations.cvec import read_gguf

        if isinstance(vector, (str, os.PathLike)):  # read here: a socket server reads no client's path
            vector = read_gguf(os.fspath(vector))
        return self.client.vector(vid, {str(il): encode(np.asarray(v, dtype=np.float32), "float32")
                                        for il, v in vector.items()})

    def free_vector(self, vid: str) -> None:
        """Release a steering vector (a request already using it keeps it to its end)."""
        self.client.free_vector(vid)

    def grammar(self, text: str) -> str:
        """Register a grammar once per server; its id (raises ServerError on a bad grammar)."""
        gid = self._grammars.get(text)
        if gid is None:
            gid = "wb-" + hashlib.sha256(text.encode()).hexdigest()[:16]
            self.client.grammar(gid, text)
            self._grammars[text] = gid
        return gid


class Document:
    """A document held on one slot: ask it any number of questions through forks."""

    def __init__(self, wb: Workbench, seq_id: int, prefilled: dict[str, Any]) -> None:
        self.wb, self.seq_id, self.prefilled = wb, seq_id, prefilled
        self.tokens: int = prefilled["tokens"]
        self.freed = False

    def generate(self, questions: Item | Sequence[Item], progress: bool | None = None,
                 **steering: Any) -> Results[Generation]:
        """One Generation per question, each continuing its own fork of the document.

        Questions go in waves of as many as there are free slots: each wave's forks are
        sent in one write and confirmed, then its questions in one write, so they are
        decoded together; `ttft_ms` runs from the question's send to its first token."""
        if self.freed:
            raise ValueError("this document was freed")
        wb, c = self.wb, self.wb.client
        items = [questions] if isinstance(questions, (str, dict)) else list(questions)
        built = [wb._infer_request(q, steering) for q in items]
        out: list[Generation | None] = [None] * len(items)
        todo = list(range(len(items)))
        with Progress(len(items), "questions", progress) as bar:
            while todo:
                wave: list[tuple[int, int]] = [(todo.pop(0), wb.slots.take_wait(c.closed))]
                while todo:
                    sid = wb.slots.take()
                    if sid is None:
                        break
                    wave.append((todo.pop(0), sid))
                try:
                    self._fork_wave(wave, built, out, bar)
                    self._ask_wave(wave, built, out, bar)
                finally:
                    for _, sid in wave:
                        wb.slots.give(sid)
        return Results(out)

    def _fork_wave(self, wave, built, out, bar) -> None:
        c = self.wb.client
        c.send_raw(b"".join(orjson.dumps({"type": "fork", "seq_id": self.seq_id, "dst_seq_id": sid}) + b"\n"
                            for _, sid in wave))
        for i, sid in list(wave):
            ev = next(iter(c.stream(self.seq_id)))  # answers come on the document's seq_id, in order
            if ev.get("type") == "closed":
                raise gone(ev)
            if ev.get("type") != "forked" or ev.get("dst_seq_id") != sid:
                out[i] = Generation(index=i, request=built[i][0], label=built[i][1],
                                    error=f"fork of the document failed: {ev.get('message', ev)}")
                bar.update(out[i])

    def _ask_wave(self, wave, built, out, bar) -> None:
        c = self.wb.client
        ask = [(i, sid) for i, sid in wave if out[i] is None]
        if not ask:
            return
        jobs = {i: built[i][0] for i, _ in ask}
        lines = [orjson.dumps({**jobs[i], "seq_id": sid}) + b"\n" for i, sid in ask]
        t_sent = time.perf_counter()
        c.send_raw(b"".join(lines))
        for i, sid in ask:
            events = list(c.stream(sid))
            if events[-1].get("type") == "closed":
                raise gone(events[-1])
            out[i] = Generation.from_events(i, jobs[i], events, t_sent, built[i][1])
            bar.update(out[i])

    def free(self) -> None:
        """Release the document's slot and cells."""
        if not self.freed:
            self.wb.client.request({"type": "free", "seq_id": self.seq_id})
            self.freed = True
            self.wb.slots.give(self.seq_id)

    def __enter__(self) -> "Document":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

