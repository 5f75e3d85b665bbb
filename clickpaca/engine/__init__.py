"""The engine behind both servers: validated requests in, events out, one decode per tick.

One room per concern (nothing is imported here: `clickpaca.engine.plan` and the other
pure modules load without the model's bindings):

    engine.py      Engine: applies `init`, routes requests to their handler between
                   ticks and ticks to the scheduler; a lost RPC worker's books
    runtime.py     what `init` loads: model, context, batch, grammar engine, mask worker;
                   the `ready` event
    prepare.py     a request's own work (tokenizing, compiling), done on the reader
                   thread that read it (Engine.prepare), else by the engine before its
                   handler: one function (work_for); it travels beside the request
                   (Prepared), never in it
    sequences.py   Session, Sequence; the slots, the active order (the sequences with a
                   job) and every ending
                   (`done`, `error`, or silently), each freeing the KV cells at once
    handlers.py    one handler per request type: the checks that need the server's state,
                   then a job started for the scheduler, or an answer
    statefiles.py  the handlers of `save` and `load` (a held sequence's cells to a state
                   file and back)
    jobs.py        a job per request kind that runs over ticks (InferJob, ScoreJob,
                   PrefillJob): what it wants from a tick, what it does with its rows
                   and with a token drawn for it (infer: accept, stops, UTF-8, the one
                   decision of its end), how it ends, the events it sends
    plan.py        the tick's plan, a pure function: what each sequence feeds (tokens,
                   positions, logits rows) and whether it samples, decided once
    scheduler.py   the tick: fill the batch from the jobs' plan, decode (recovering from a
                   full KV cache), advance each sequence by its plan entry, hand each job
                   its share, sample the rows they asked for in one call
    tick_sampling.py  that call, and the pre-selection's owner: the rows ordered before
                   the decode, each row's route after it (sampling/route.py), the K a
                   sequence asks for, the whole row where the values cannot decide
    readout.py     activation capture through the jobs: which rows of a tick's batch each
                   job reads, and what it keeps of them until its end event
    patches.py     activation patching through the jobs: a request's patch checked, and
                   the rows of each tick's batch its job writes
    lensjob.py     one request's logit lens: its rows through the final norm and head,
                   kept as its token events' or end event's `lens`
    mask_ahead.py  grammar masks filled while the decode runs
    jump.py        jump-forward: the tokens a grammar forces, fed as one chunk of the next
                   decode instead of a tick each
    faults.py      the stages of one sequence's service in a tick (a failure there
                   ends that sequence alone), how a batch-wide step finds whose part
                   failed (`each`), and the tests' hook that fails one
    text.py        token bytes -> valid UTF-8 pieces; stop strings
    stateio.py     state files (`save`, `load`) hashed, written and read on a worker
                   thread; completions come back through the server's inbox
    kvstate.py     the state file format: a sequence's cells and tokens, verified
    accounting.py  the `stats` books and the per-session grammar bounds
    statedir.py    where `save` and `load` may touch the file system: names inside one
                   state directory, never a path

Requests arrive as typed requests (protocol.InferRequest, ...) validated by
clickpaca.wire.protocol, the edge, where every check that needs only the request is made.
"""
