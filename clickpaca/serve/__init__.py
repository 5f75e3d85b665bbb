"""Serving the engine: server.py on stdin/stdout (`clickpaca serve`) and the transport
loop both servers share; socket_server.py the same protocol over a Unix socket, many
clients on one model and one batch."""
