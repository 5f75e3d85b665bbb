"""Below the tokens: read a sequence's activations (capture.py), derive a control vector
from contrastive prompts (cvec.py) and apply one to a context (steer.py).

These are the pieces the per-request jobs of the engine will call; docs/ACTIVATIONS.md
says what exists, what it costs and what is left.
"""
