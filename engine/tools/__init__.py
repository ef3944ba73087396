"""Tool calling (OpenAI ``tools`` / ``tool_choice`` on chat completions, as vLLM does it).

``spec.py`` parses and checks a request's tool fields into one ``ToolCalling`` (and builds
the structured output a named or ``"required"`` tool choice is constrained by);
``output.py`` turns one choice's generated text into content and tool calls, streamed or
whole; ``parsers/`` holds the parsers of ``"auto"`` tool choice (``--tool-call-parser``),
one file each, and their registry. Pure: no engine, no I/O, no ``llguidance``.
"""
