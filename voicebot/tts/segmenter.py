"""Split streamed reply text into sentences, for engines that speak whole sentences.

Text arrives as deltas (a token at a time); a sentence is released as soon as its end punctuation
(Chinese or English) is seen and it is at least `min_chars` long, so the first sentence starts
speaking early. Runs of end marks ("...", "?!", "。。。", "……") and closing quotes or brackets stay
with their sentence. A '.' is not an end between digits (3.14), before a letter or digit
(example.com, e.g.) or after a common abbreviation (Mr. Smith). A sentence still unfinished past
`max_chars` is cut at its last clause mark (，,、：;) or space, else at `max_chars`, so a long
sentence does not hold back speech and the buffer stays bounded by `max_chars`.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

ENDERS = set("。！？；!?;…\n")
CLOSERS = set("\"'”’」』）)]】》")
CLAUSE_MARKS = set("，,、：:")
ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "etc", "e.g", "i.e", "approx"}
_WORD_BEFORE = re.compile(r"[A-Za-z.]+$")


class SentenceSegmenter:
    def __init__(self, min_chars: int = 6, max_chars: int = 150) -> None:
        self.min_chars = min_chars
        self.max_chars = max(max_chars, min_chars + 1)
        self._buffer = ""
        self._scan = 0  # the buffer before this index holds no sentence end

    def push(self, delta: str) -> list[str]:
        self._buffer += delta
        sentences = []
        while (cut := self._next_cut()) is not None:
            sentence, self._buffer, self._scan = self._buffer[:cut].strip(), self._buffer[cut:], 0
            if sentence:
                sentences.append(sentence)
        return sentences

    def flush(self) -> str | None:
        rest, self._buffer, self._scan = self._buffer.strip(), "", 0
        return rest or None

    def _next_cut(self) -> int | None:
        """Where the first complete sentence of the buffer ends, or None to wait for more text."""
        text = self._buffer
        i = self._scan
        while i < len(text):
            if not self._is_end(text, i):
                i += 1
                continue
            # A boundary is only final once the next character shows it is one.
            j = i + 1
            while j < len(text) and (text[j] in ENDERS or text[j] == "." or text[j] in CLOSERS):
                j += 1
            if j == len(text):
                self._scan = i  # more end marks or a closing quote may follow in the next delta
                return None
            if len(text[:j].strip()) >= self.min_chars:
                return j
            i = j
        self._scan = len(text)
        return self._long_sentence_cut(text) if len(text) > self.max_chars else None

    def _long_sentence_cut(self, text: str) -> int:
        window = text[: self.max_chars]
        for marks in (CLAUSE_MARKS, set(" \t")):
            k = max((n for n, ch in enumerate(window) if ch in marks), default=-1)
            if k >= self.min_chars:
                return k + 1
        return self.max_chars

    @staticmethod
    def _is_end(text: str, i: int) -> bool:
        if text[i] in ENDERS:
            return True
        if text[i] != ".":
            return False
        after = text[i + 1] if i + 1 < len(text) else ""
        if after.isascii() and after.isalnum():
            return False  # 3.14, example.com, e.g
        word = _WORD_BEFORE.search(text, 0, i)
        return not (word and word.group().lower() in ABBREVIATIONS)


async def sentences(deltas: AsyncIterator[str]) -> AsyncIterator[str]:
    """The sentences of streamed text, each as soon as it is complete; the unfinished rest at the end."""
    segmenter = SentenceSegmenter()
    async for delta in deltas:
        for sentence in segmenter.push(delta):
            yield sentence
    rest = segmenter.flush()
    if rest:
        yield rest
