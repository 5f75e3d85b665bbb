"""Benchmarks of the clickpaca server against llama.cpp's own tools (same build, model, threads).

One module per job:
  stats    medians, ratios, alternation of compared runs
  table    markdown tables
  tools    run and parse llama-bench / llama-batched-bench / llama-perplexity
  serve    a timed client for the real server, prompts of exact length, EOG bans
  report   JSON output, machine description, plots
  texts    the default public-domain text (a Shakespeare play)
  decode, batch, grammar, sampler, kv, state   the `clickpaca bench WHAT` commands
  ppl, kl  `clickpaca ppl`: perplexity through the server, KL / top-1 in-process
  cli      dispatch and `bench all`
"""
