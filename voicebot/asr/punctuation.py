"""FunASR's punctuation model (CT-Transformer: ct-punc, ct-punc-c) on each utterance's final
text (`asr.paraformer.punc_model`).

Paraformer writes no punctuation. FunASR's own 2pass server punctuates each segment's final
result, and so does this: the punctuated text is the final every client gets (session events,
/funasr's `2pass-offline`, transcriptions) and what the turn-taking policy's words weigh
(voicebot/audio/turn_words.py: a turn whose text ends in 。 or ？ goes, one ending in ， or 、 waits).

The model is funasr's own class, loaded from a local directory by the same checked loader as the
recognizers (voicebot/asr/funasr_model.py: `load_automodel`), on its own single worker thread
(funasr's AutoModel is not thread-safe). One call per utterance, each session awaiting its own,
so the queue holds at most one call per session. Nothing is kept between calls: each utterance
is punctuated alone. The realtime model (CTTransformerStreaming,
punc_ct-transformer_zh-cn-common-vad_realtime) is refused: its point is the context it carries
from segment to segment (a `pre_text` cache that grows until it predicts a sentence end), and
funasr 1.4.16's inference of it fails on a one-word text (a TypeError in its own loop).

The text keeps the model's own verdict at its end. funasr's inference decides the last mark
itself: CTTransformer always ends the text with a full stop (a comma or no mark there becomes
"。"), so every punctuated text would say the turn is over, whatever the model predicted. So the
model's last call is watched (its logits for the last word), and the text ends with the mark the
model gave that word: "。", "？", "，", "、" or none ("_"); after a Latin word, the ASCII mark as
funasr writes it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from voicebot.asr.funasr_model import load_automodel
from voicebot.serving.worker import Worker

log = logging.getLogger(__name__)

PUNCTUATION_CLASS = "CTTransformer"
MARKS = ("，", "。", "？", "、")  # the released models' marks; "_" (none) and "<unk>" are no mark
# How funasr writes a mark after a Latin word (CTTransformer.inference).
ASCII_MARKS = {"，": ",", "。": ".", "？": "?"}
# Every mark funasr may have put at the end of the text: the model's, and their ASCII forms.
_ENDINGS = "，。？、,.?"


def with_end_mark(text: str, mark: str) -> str:
    """`text` (funasr's punctuated output) ending in `mark` instead of whatever funasr put there."""
    body = text.strip()  # funasr starts a text whose first word is Latin with a space
    if body and body[-1] in _ENDINGS:
        body = body[:-1]
    if mark not in MARKS or not body:
        return body
    return body + (ASCII_MARKS.get(mark, mark) if body[-1].isascii() else mark)


class Punctuator:
    """One loaded CT-Transformer, shared by every session; calls run on its own worker thread."""

    def __init__(self, name: str, path: Path, device: str = "cpu", threads: int = 1) -> None:
        self.name = name
        self.path = Path(path)
        self.device = device
        self.threads = threads
        self.worker = Worker(name, threads=1)
        self.calls = 0  # texts punctuated, for tests and the bench
        self._auto: Any = None
        self._punc_list: list[str] = []
        self._last_logits: Any = None  # the model's last call's logits, (words, classes): its last row is the text's end

    def load(self) -> None:
        """Blocking: build the model from its directory, verify its checkpoint, watch its calls."""
        auto = load_automodel(self.path, self.device, self.threads)
        kind = type(auto.model).__name__
        if kind != PUNCTUATION_CLASS:
            raise ValueError(f"{self.path}: model class {kind} is not supported as the punctuation model (need "
                             f"{PUNCTUATION_CLASS}: ct-punc or ct-punc-c; the realtime model's inference fails on one word)")
        model = auto.model
        self._punc_list = list(model.punc_list)
        original = model.punc_forward

        def watched(*args, **kwargs):
            y, rest = original(*args, **kwargs)
            self._last_logits = y[0]
            return y, rest

        model.punc_forward = watched  # only this punctuator's worker thread calls it
        self._auto = auto
        log.info("loaded %s (%s) from %s", self.name, kind, self.path)

    @property
    def class_name(self) -> str:
        return type(self._auto.model).__name__

    def punctuate_blocking(self, text: str) -> str:
        """`text` punctuated, ending in the model's own mark for its last word (worker thread only)."""
        if not text.strip():
            return text
        self._last_logits = None
        result = self._auto.generate(input=text, cache={}, key="punctuation")
        self.calls += 1
        punctuated = result[0]["text"] if result else ""
        if self._last_logits is None or not punctuated:
            return punctuated
        last = self._punc_list[int(self._last_logits[-1].argmax())]
        return with_end_mark(punctuated, last)

    async def punctuate(self, text: str) -> str:
        return await self.worker.run(self.punctuate_blocking, text)

    def close(self) -> None:
        self.worker.shutdown()
        self._auto = None
