"""A fixed word list: random text prompts (``pd-bench serve --prompt-type text``) draw from
it, and the tokenizer ``pd-bench make-model`` writes has a token for each word, so against
such a checkpoint one word is one token."""

from __future__ import annotations

_TEXT = """
the of and to in is was for on that with as by at from his it an were are which this be
be has or had not but first one their its new after who they have her she two been other
when there all during into school time may years more most only over city some world
would where later up such used many can state about national out known university united
then made these world system part well team under war than age between american three
both when while high group also life film name people early series music work through
each year long house water small light night point river game home place state number
best great old large line public last right city court book since power field general
set around left form side station league back area held four end based area family team
king album march series season west south north east club record order major song end
early film land took population law company being five local named island play built
town against served game president development area following began due several second
house often world country days church across near within released despite single open
same member times support among village along became death different early given played
written form career led won main taken top run short white red green blue black gold
stone road hill lake forest sea wind rain snow sun moon star sky cloud fire earth metal
wood glass paper cloth bread milk fruit seed tree flower grass leaf root branch animal
bird fish horse dog cat cow sheep bear wolf fox mouse lion tiger eagle snake frog bee
ant child mother father brother sister friend teacher doctor farmer worker writer singer
"""
# Deduplicated, order kept.
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_TEXT.split()))
