"""Below the tokens: read a sequence's activations (capture.py), derive a control vector
from contrastive prompts (cvec.py), apply one to a context (steer.py), and steer each
sequence with its own strength (vector.py: init's controlVector and infer's
controlVectorStrength, whose wire form wire.py checks; the activations build), steer each
request with vectors of its own (steering.py: the `vector` request, `steer` with triggers
and gates, in K slots whose books slots.py keeps), write rows into a node during a decode
(patching.py: activation patching, through the same live callback; patch_wire.py checks
the request's `patch`), and apply the final norm and output head to a layer's rows, the
logit lens (lens.py; its numpy check lens_reference.py).

cost.py is the cost measurement of docs/ACTIVATIONS.md (the lens's: measure/lens_cost.py), which says what exists, what it
costs and what is left; its worked experiment (through the server) is
clickpaca.measure.steering.
"""
