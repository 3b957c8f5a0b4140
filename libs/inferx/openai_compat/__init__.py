"""The OpenAI-compatible HTTP front's pure parts: request bodies, the chat rendering,
program identity from headers, response bodies, and errors as OpenAI shapes them.

No HTTP server and no gRPC here (tests/unit/test_layering.py checks it): the router's
`inferx_router.http_front` is the I/O around these functions.
"""
