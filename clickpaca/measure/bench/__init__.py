"""Benchmarks of the clickpaca server against llama.cpp's own tools (same build, model, threads).

One module per job:
  tools    run and parse llama-bench / llama-batched-bench / llama-perplexity
  serve    a timed client for the real server, prompts of exact length, EOG bans
  cachetypes  bits per value as a build reports them, which builds are here
  decode, batch, grammar, sampler, kv, state   the `clickpaca bench WHAT` commands
  sampler_steps, sampler_ticks   parts of `bench sampler`: each step beside llama.cpp's,
           the host's sampling time per tick
  sampler_against  an earlier commit's sampler chain against this tree's (python -m)
  preselect_ops  what the pre-selection's graph ops add to a decode (python -m)
  preselect_host  the pre-selection's whole host share on a real decode (bench sampler)
  decode_against   an earlier commit's whole server against this tree's: decode tok/s at 1, 8, 64 sequences (python -m)
  builds   two builds of one source against each other (llama-bench, alternating)
  rpc      `bench decode|batch --rpc`: local, one worker and two, in one run
  peer     `bench peer`: against llama-server on the same loads (peer_loads: the loads,
           peer_sides: one timed run on each side, peer_check: every output checked,
           llama_server: starting and driving llama-server)
  schemas  `bench schemas DIR|PACKAGE`: a schema corpus through clickpaca and llama-server,
           every output validated
  ppl      `clickpaca ppl`: perplexity through the server, KL / top-1 in-process
  cli      dispatch and `bench all`

Shared with retrieval/: measure/common.py (arguments: threads, model, output folder), kl.py, texts.py; what a run writes and its
statistics: results/report.py, table.py, stats.py; cache types: llama/cachetypes.py.
"""
