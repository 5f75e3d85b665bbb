"""Generate cffi ABI-mode bindings for llama.cpp from each build's own llama.h."""
