"""Context assembly: what each model call reads, within the model's window.

``history`` holds a session's entries and the sticky compaction view over them; ``assemble``
renders pinned blocks, digest, history, input and this turn into a request, block by block with
tokens; ``ladder`` decides and applies the compaction stages; ``digest`` writes digests;
``load`` rehydrates a session from its snapshot and ``replay`` rebuilds what a past turn read.
"""
