"""Structured outputs (constrained decoding) with ``llguidance``.

``spec.py`` parses a request's structured-output fields into one ``StructuredOutput``;
``compiler.py`` turns it into grammars (checked at entry, compiled per tokenizer, cached);
``matcher.py`` is a running request's grammar state and the step's token bitmask;
``reasoning.py`` holds the grammar back while an answer reasons (``--reasoning-parser``). The
package imports ``llguidance`` only when a request asks for a structured output (it is the
``structured`` extra: ``pip install 'pdserve[structured]'``), and never torch.
"""
