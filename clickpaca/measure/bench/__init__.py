"""Benchmarks of the clickpaca server against llama.cpp's own tools (same build, model, threads).

benches.py is the list of `clickpaca bench WHAT` (one row each: name, module, help, `bench
all`'s options, the checks before any work); cli.py runs them. One module per job:
  tools    run and parse llama-bench / llama-batched-bench / llama-perplexity
  serve    a timed client for the real server, prompts of exact length, EOG bans
  cachetypes  bits per value as a build reports them, which builds are here
  decode, batch, grammar, sampler, kv, state, peer, schemas   the benches (benches.py)
  sampler_steps, sampler_ticks, preselect_host, sampler_against   parts of `bench sampler`:
           each step beside llama.cpp's, the host's sampling time per tick (--seqs), the
           pre-selection's host share on a real decode, an earlier commit's sampling (--against)
  against  an earlier commit's tree beside this one (`bench sampler|batch --against REV`)
  rpc      `bench decode|batch --rpc`: local, one worker and two, in one run
  peer_loads, peer_sides, peer_check, llama_server   parts of `bench peer` (the loads, one
           timed run on each side, every output checked, starting and driving llama-server)
  ppl      `clickpaca ppl`: perplexity through the server, KL / top-1 in-process

Shared with retrieval/: measure/common.py (arguments: threads, model, output folder),
checks.py (what is checked before any work, what marks a run failed), kl.py, texts.py; what
a run writes and its statistics: results/report.py, table.py, stats.py; cache types:
llama/cachetypes.py.
"""
