"""The ground floor: modules that import nothing of clickpaca, so every layer may use
them. paths.py is where clickpaca keeps what it downloads and builds ($CLICKPACA_CACHE)
and how it fingerprints files; fieldcheck.py checks a request's fields and words their
errors, one style for the protocol (wire/protocol/) and the sampler step registry
(sampling/registry.py); offline.py takes a download from the offline bundle
($CLICKPACA_BUNDLE, `make setup BUNDLE=dir`) or refuses it by name; order.py is the
canonical order of a candidate set as one sortable key (the sampler chain's and the
pre-selection's); malloc.py caps glibc's arenas for a long-running server; cores.py counts the cores
this process may run on."""
