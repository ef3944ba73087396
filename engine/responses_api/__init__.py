"""OpenAI's Responses API (``POST /v1/responses``) over the chat completions path.

A Responses request is translated into a chat completions request (``request.py``), which
the node or the proxy serves as it serves any chat request (P/D pairing, retries, tools,
reasoning, structured outputs); its answer is translated back: a body into a ``response``
object (``output.py``), a stream of chat chunks into the Responses API's typed events
(``stream.py``). ``route.py`` is the HTTP glue both apps share. Stateless, as vLLM
without ``VLLM_ENABLE_RESPONSES_API_STORE``: nothing is stored (``store`` is answered
``false``; ``previous_response_id``, ``conversation`` and ``background`` get a 400).
docs/api.md lists the fields.
"""
