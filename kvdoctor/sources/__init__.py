"""Sources: one module per input, each turning raw input into facts (kvdoctor.facts).

Sources know nothing of rules or faces. Every parser raises kvdoctor.facts.SourceError with a
one-line message (what, where, why) on input it cannot read.
"""
