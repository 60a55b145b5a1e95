"""Speech transcribed into subtitle cues when a video has no subtitles (`--subtitles auto|speech`).

Built on faster-whisper (Whisper on CTranslate2; the optional `[speech]` extra): its Silero voice
activity filter keeps silence and music from becoming text, and its word timestamps place each word
in time. Every rank decodes its own pieces of the audio from the file (`audio`), cut at silences on
a grid that does not depend on the number of ranks (`pieces`), so 1 and 8 ranks make the same
cues; `join` keeps each word at a cut once and ends cues at sentence ends. `sharded` runs the
pieces on the group, the cache kind `lvx_app.cache.transcripts` keeps the result, `model` finds and
loads the checkpoint.
"""
