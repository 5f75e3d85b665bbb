"""The handlers of `save` and `load`: a held sequence's cells to a state file and back.

The checks and the cell copy run on the engine thread; hashing, writing and reading run
on the state-file worker, and the answer follows when the file work is done
(stateio.py). Handlers (handlers.py) takes these as its own.
"""

from __future__ import annotations

import os

from . import statedir
from ..wire.protocol import LoadRequest, ProtocolError, SaveRequest, error_event, loaded_event, saved_event
from . import kvstate
from .prepare import Prepared
from .runtime import Runtime
from .sequences import Sequences, Session
from .stateio import StateIO


class StateFileHandlers:
    rt: Runtime
    seqs: Sequences
    io: StateIO

    def save(self, session: Session, req: SaveRequest, work: Prepared) -> None:
        """The cells are copied out now (the sequence may change right after); hashing
        and writing run on the state-file worker, and `saved` follows when the file is
        in place (stateio.py)."""
        seq_id = req.seq_id
        seq = session.seqs.get(seq_id)
        if seq is None or not seq.held:
            raise ProtocolError(f"seq_id: sequence {seq_id} holds no state to save", seq_id, "save")
        path, shared, replace = req.path, req.shared, req.replace

        def may_replace(dir_fd: int, name: str) -> None:
            kvstate.refuse_foreign(dir_fd, name)
            if shared and not replace:
                raise kvstate.StateFileError(f"{name!r} already exists in the shared namespace "
                                             "(save with replace: true to overwrite it)")
        try:
            dir_fd, name, label = self.rt.states.locate(path, session.namespace, shared)
        except statedir.StatePathError as e:
            raise ProtocolError(_path_message(e), seq_id, "save") from None
        try:
            snapshot, n_past = kvstate.Snapshot(self.rt.ctx, seq.slot, seq.tokens), seq.n_past
        except BaseException:
            os.close(dir_fd)
            raise

        def write() -> int:
            try:
                return statedir.write_file(dir_fd, name, snapshot.chunks(), label, may_replace)
            finally:
                os.close(dir_fd)

        def then(n_bytes: int | None, error: Exception | None) -> None:
            if error is None:
                session.send(saved_event(seq_id, path, n_bytes, n_past))
            else:
                session.send(_file_error(error, path, "written", seq_id, "save").event())

        self.io.submit(session, write, then, lambda msg: session.send(ProtocolError(msg, seq_id, "save").event()))

    def load(self, session: Session, req: LoadRequest, work: Prepared) -> None:
        """The seq_id is taken now (state "loading": not scheduled, refused to others);
        the file is read and verified on the state-file worker, then restored into the
        cells here and answered with `loaded` (stateio.py)."""
        seqs = self.seqs
        seq_id, path = req.seq_id, req.path
        seqs.check_id(seq_id, "load")
        if seq_id in session.seqs:
            raise ProtocolError(f"seq_id: sequence {seq_id} is in use (free it first)", seq_id, "load")
        try:
            dir_fd, name, label = self.rt.states.locate(path, session.namespace, req.shared)
        except statedir.StatePathError as e:
            raise ProtocolError(_path_message(e), seq_id, "load") from None
        try:
            seq = seqs.new(session, seq_id, "load")  # held once its file is in the cells
        except BaseException:
            os.close(dir_fd)
            raise
        seq.loading = True

        def read() -> tuple[dict, list[int], bytes]:
            try:
                return kvstate.decode(statedir.read_file(dir_fd, name, label), label)
            finally:
                os.close(dir_fd)

        def mine() -> bool:
            return session.seqs.get(seq_id) is seq and seq.loading

        def then(decoded, error: Exception | None) -> None:
            if not mine():  # freed, or its client went away, while the file was read
                session.send(error_event(f"seq_id: sequence {seq_id} was freed before its state "
                                         "was loaded", seq_id, "load"))
                return
            try:
                if error is not None:
                    raise _file_error(error, path, "read", seq_id, "load")
                try:
                    tokens = kvstate.restore(self.rt.ctx, seq.slot, *decoded, label)
                except kvstate.StateFileError as e:
                    raise ProtocolError(_path_message(e), seq_id, "load") from None
            except ProtocolError as e:
                seqs.release(seq)
                session.send(e.event())
                return
            seq.tokens, seq.n_past = tokens, len(tokens)
            seq.loading = False
            session.send(loaded_event(seq_id, seq.n_past))

        def on_bug(message: str) -> None:
            if mine():
                seqs.release(seq)
            session.send(error_event(message, seq_id, "load"))

        self.io.submit(session, read, then, on_bug)


def _file_error(e: Exception, path: str, done: str, seq_id: int, kind: str) -> ProtocolError:
    """A failed state-file job as the request's error (names the field `path`)."""
    if isinstance(e, (statedir.StatePathError, kvstate.StateFileError)):
        return ProtocolError(_path_message(e), seq_id, kind)
    if isinstance(e, OSError):
        return ProtocolError(f"path: {path[:60]!r} cannot be {done} ({e.strerror})", seq_id, kind)
    raise e


def _path_message(e: Exception) -> str:
    """A state-file error as an `error` message that names the field `path`."""
    msg = str(e)
    return msg if msg.startswith("path:") else f"path: {msg}"
