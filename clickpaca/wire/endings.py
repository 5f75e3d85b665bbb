"""The event types that answer a request on its seq_id: the last event a client waits
for there. Apart from protocol/events.py (which checks, at import, that its constructors
registered with `ends=True` are exactly these) so a client learns them without importing
the protocol's validation, numpy and the sampler."""

END_EVENTS = frozenset({"done", "error", "scored", "prefilled", "forked", "saved", "loaded", "freed"})
