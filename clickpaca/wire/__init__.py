"""The wire: what travels between a client and the server as NDJSON lines, and both of
its ends. protocol/ turns a line into a typed request with every check that needs no
state, and builds the events; endings.py the events that end a request; chat.py
messages -> prompt text through llama.cpp's chat templates; pretokenize.py tokenizing
any text in linear time; scoring.py the score request's windows and NLL rows;
client.py the client end (spawn or connect to a server, send requests, read events)."""
