"""Split streamed reply text into sentences, for engines that speak whole sentences.

Text arrives as deltas (a token at a time); a sentence is released as soon as its end punctuation
(Chinese or English) is seen and it is at least `min_chars` long, so the first sentence starts
speaking early. A '.' between digits (3.14) is not an end; runs of end marks ("...", "?!", "。。。")
and closing quotes or brackets stay with their sentence. Memory bound: the unfinished sentence.
"""

from __future__ import annotations

ENDERS = set("。！？；!?;…\n")
CLOSERS = set("\"'”’」』）)]】》")


class SentenceSegmenter:
    def __init__(self, min_chars: int = 6) -> None:
        self.min_chars = min_chars
        self._buffer = ""

    def push(self, delta: str) -> list[str]:
        self._buffer += delta
        sentences = []
        start = 0
        i = 0
        text = self._buffer
        while i < len(text):
            if self._is_end(text, i):
                # A boundary is only final once the next character shows it is one.
                j = i + 1
                while j < len(text) and (text[j] in ENDERS or text[j] == "." or text[j] in CLOSERS):
                    j += 1
                if j == len(text):
                    break  # more end marks or a closing quote may follow in the next delta
                candidate = text[start:j].strip()
                if len(candidate) >= self.min_chars:
                    sentences.append(candidate)
                    start = j
                i = j
                continue
            i += 1
        self._buffer = text[start:]
        return sentences

    def flush(self) -> str | None:
        rest, self._buffer = self._buffer.strip(), ""
        return rest or None

    @staticmethod
    def _is_end(text: str, i: int) -> bool:
        ch = text[i]
        if ch in ENDERS:
            return True
        if ch != ".":
            return False
        before = text[i - 1] if i > 0 else ""
        after = text[i + 1] if i + 1 < len(text) else ""
        if before.isdigit() and (after.isdigit() or after == ""):
            return False  # a decimal point (or possibly one: wait for the next delta)
        return True
