"""The HTTP kit shared by the node server and the proxy (never imports torch).

- ``sse.py`` — server-sent-event framing and a streaming response that always closes its
  generator.
- ``big_json.py`` — large JSON answers rendered (and built, parsed) off the event loop.
- ``disconnect.py`` — racing a handler's work against the client going away.
- ``request_id.py`` — the ``X-Request-Id`` rule (one sanitiser) and the ASGI middleware
  that assigns, echoes and times it.
- ``errors.py`` — OpenAI-shaped error responses for framework errors (404, 405, bad body).
- ``openai.py`` — response ids and the envelope of completion and chat objects.
- ``serve.py`` — binding the listening socket and the uvicorn serve loop with a banner.
"""
