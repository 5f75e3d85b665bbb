"""Simulated KV cache types inside the model (docs/KV-RESEARCH.md, "Beyond one model").

quant.py: numpy quantize-dequantize round trips (ggml's q8_0/q4_0, TurboQuant-mse, the
outlier split, centering); hook.py: the eval callback that writes them into a decode's K and
V before the cache stores them; study.py: the measurement (`python -m clickpaca.measure.kvsim`,
__main__); mse.py: each round trip's error on captured K/V; figures.py: the two-model figures;
center.py: `clickpaca kv-center`, the study's calibrated key center as a file for init's kvCenter.
"""
