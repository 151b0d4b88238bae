"""The terminal chat client (`taper chat`): a client of the API, importing nothing from the
engine or the server app."""
