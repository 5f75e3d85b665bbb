"""llama.cpp access: every module that loads or calls the native library, or says how
a build behaves. native.py loads a build's cffi bindings (cpu.py: which CPU it was made
for), features.py is the table of optional llama.cpp APIs checked at init, core.py
wraps model, context, batch, logits and memory; models.py finds and fetches the model
files and tok.py is `clickpaca tok`; cachetypes.py is the table of KV cache types,
deterministic.py deterministic mode's settings, gpu.py what a GPU build lists and refuses,
backends.py the defaults that depend on the backend (one row each),
turboquant.py the turbo types' codebooks
and numpy reference; opdump.py and opdiff.py find which graph node depends on batch
shape; presample/ the backend sampler whose ggml ops pre-select each sampled row's
values inside the decode (and their numpy reference); kvcenter.py the key center's file and
its setting on a context (the kvcenter patch's llama_set_kv_center). Nothing here imports a layer above it (sampling, grammar, wire, engine, ...)."""
