"""Grammars, below the wire and above the sampler: grammars/ turns a request's
grammar text into per-sequence matchers and token masks for a whole batch (llguidance,
its bitmask format from sampling/bitmask.py); gbnf.py translates llama.cpp's GBNF into
llguidance's Lark dialect; json_schema.py bounds a JSON schema's numbers and reports its
lenient keywords; schema_coverage.py walks a schema as llguidance compiles it and lists
exactly what is not enforced (keyword, JSON path, reason); schema_rewrite.py rewrites
the keywords llguidance lacks (`not`, `if`, dependencies) into ones it has, where that is
exact; json_keys.py bans the tokens that would repeat a key of a JSON object (beside
llguidance's mask); schema_check.py validates a
finished output against the whole schema (jsonschema, draft from `$schema`)."""
