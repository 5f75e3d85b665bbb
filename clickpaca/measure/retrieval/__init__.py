"""`clickpaca kv-retrieval`: does a KV cache type keep what a long context is for?

A haystack of public-domain text holds needles (facts with one answer) at several depths;
it is prefilled once per cache type and each needle's question is asked through a fork
of that one prefill (the held-document workflow). One module per job:
  haystack  needles and their placement in the text (pure: token arrays in, tokens out)
  runner    one prefill, the forked questions: teacher-forced answer rows and greedy answers
  stats     per-needle measures, paired bootstrap intervals across needles, the noise floor
  command   the command: variants, the table, the plot, the results store
"""
