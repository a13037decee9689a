"""The text side of a bistream reply (text_input: bistream): reply deltas cut into pieces as their
words complete (`WordFeed`, on the loop), each pushed into the utterance's LM program
(`BistreamText`, on the scheduler thread)."""

from __future__ import annotations

from voicebot.tts.cosyvoice2.bistream import Bistream
from voicebot.tts.cosyvoice2.frontend import TextFrontend, language
from voicebot.tts.cosyvoice2.lm_pool import LMPool, LMRow
from voicebot.tts.segmenter import CLAUSE_MARKS, SentenceSegmenter


class WordFeed:
    """Streamed reply text -> the pieces to push into a bistream request, each as soon as its words
    are complete: `push(delta)` and `flush()` give (piece, ends a sentence) pairs. A word is complete
    once a space or a clause mark follows it (Chinese, which has no spaces, goes a clause at a time);
    a sentence (SentenceSegmenter) ends with the rest of its text. A piece starts with the space
    before its first word, so " world," tokenizes as inside the whole text, and the pieces put
    together are the text as written.

    Bounds: it holds the unfinished sentence, which the segmenter cuts at max_chars (150)."""

    def __init__(self) -> None:
        self.segmenter = SentenceSegmenter()
        self.text = ""  # the unfinished sentence as received, from the end of the last one
        self.fed = 0  # characters of `text` already given out as pieces

    def push(self, delta: str) -> list[tuple[str, bool]]:
        self.text += delta
        pieces = [piece for sentence in self.segmenter.push(delta) for piece in self._sentence(sentence)]
        # The complete words end before the last space (which goes with the next word) or after
        # the last clause mark.
        words_end = max((i + (c in CLAUSE_MARKS) for i, c in enumerate(self.text)
                         if i >= self.fed and (c.isspace() or c in CLAUSE_MARKS)), default=self.fed)
        if self.text[self.fed : words_end].strip():
            pieces.append((self.text[self.fed : words_end], False))
            self.fed = words_end
        return pieces

    def flush(self) -> list[tuple[str, bool]]:
        rest = self.segmenter.flush()
        return self._sentence(rest) if rest else []

    def _sentence(self, sentence: str) -> list[tuple[str, bool]]:
        """The rest of a sentence the segmenter completed (its text, stripped, starts at the first
        character after the previous sentence that is not a space)."""
        start = len(self.text) - len(self.text.lstrip())
        end = self.text.index(sentence, start) + len(sentence)
        rest, self.text, self.fed = self.text[self.fed : end], self.text[end:], 0
        return [(rest, True)] if rest.strip() else [("", True)]


class BistreamText:
    """A bistream utterance's text side, on the scheduler thread: its `Bistream` LM program (`lm`),
    started on its row of the pool as each piece of text arrives."""

    def __init__(self, pool: LMPool, row: LMRow, lm: Bistream, frontend: TextFrontend) -> None:
        self.pool, self.row, self.lm, self.frontend = pool, row, lm, frontend
        self.text = ""  # the sentences it voices so far

    @property
    def full(self) -> bool:
        """Start the next sentence in a new utterance: this one has the official utterance length
        (token_min_n text tokens), or has used half its KV slot."""
        return self.lm.n_text >= self.frontend.token_min_n or 2 * self.lm.pos > self.lm.max_seq_len

    def push_text(self, piece: str) -> None:
        """A piece of the reply as written (words, with the space before them): its tokens, as the
        official frontend tokenizes each piece a text generator yields."""
        # The space before the piece: "Hi." + " How" tokenizes as the whole text would.
        joiner = " " if self.text and piece[:1].isspace() and language(piece) == "en" else ""
        self.text += joiner + piece.strip()  # as written: what the pacer reports as heard
        self.pool.start(self.row, self.lm.push(self.frontend.encode(joiner + self.frontend.normalize(piece))))

    def end_text(self) -> None:
        self.pool.start(self.row, self.lm.finish())
