"""Measurements: commands that drive the model or the server and record what they find
in the results store (results/). bench/ is `clickpaca bench ...` and `clickpaca ppl`;
retrieval/ is `clickpaca kv-retrieval`; what the two share sits here: common.py (the
commands' shared arguments), checks.py (what every command checks before any work, what
marks its run failed, and `measured`, which runs it between the two), kl.py (KL and top-1 against a reference, in-process),
texts.py and corpus.py (the default public-domain texts); steering.py is the worked
control-vector experiment of docs/ACTIVATIONS.md, through the server, patching.py what
activation patching costs there, and lens_cost.py the logit lens's cost there (a lens on
every layer against none); schemas.py reads a
corpus of JSON schemas from a directory or an installed package (`bench schemas`);
gpucheck.py is `make gpu-check` (docs/GPU.md), gpuagree.py the CPU reference a GPU pack
carries and the GPU run's check against it; kvsim/ simulates KV cache types inside the
model (docs/KV-RESEARCH.md, "Beyond one model"); soak.py is `make soak`, many socket
clients for a fixed time with what must hold throughout (docs/PROTOCOL.md, "Soak")."""
