"""What a public show must never say: a blocklist of words and phrases, and a maximum reply length.

Applied to the reply text as it streams, before it is spoken or shown, so history (which holds
what was heard) never holds a blocked word either. Matching is case-insensitive; a phrase that
begins or ends with a Latin letter or digit matches only at word boundaries there ("ass" is not
found in "class"), while Chinese phrases match anywhere. A phrase may arrive split over deltas,
so the last (longest phrase) characters are held back until the next delta shows what they are;
with an empty blocklist nothing is held back.
"""

from __future__ import annotations

import contextlib
import re
from typing import AsyncIterator

from voicebot.config.engines import ReplyConfig

_WORD = "A-Za-z0-9"
_TRAILING_WORD = re.compile(f"[{_WORD}'’-]+$")


class SpeechFilter:
    def __init__(self, blocklist: list[str], replacement: str = "", max_chars: int = 0) -> None:
        phrases = sorted({p.strip() for p in blocklist if p.strip()}, key=len, reverse=True)
        self.pattern = re.compile("|".join(_phrase_pattern(p) for p in phrases), re.IGNORECASE) if phrases else None
        self.hold = max((len(p) for p in phrases), default=0)
        self.replacement = replacement
        self.max_chars = max_chars

    @classmethod
    def from_config(cls, config: ReplyConfig) -> "SpeechFilter":
        phrases = list(config.blocklist)
        if config.blocklist_file is not None:
            try:
                phrases += config.blocklist_file.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"reply.blocklist_file: cannot read {config.blocklist_file}: {exc}") from exc
        return cls(phrases, config.blocklist_replacement, config.max_reply_chars)

    def scrubber(self) -> "Scrubber":
        return Scrubber(self)

    async def apply(self, deltas: AsyncIterator[str], scrubber: "Scrubber | None" = None) -> AsyncIterator[str]:
        """The filtered text of a stream of deltas; past max_chars the source is closed (pass your
        own `scrubber` to read what was cut: `Scrubber.cut`)."""
        scrubber = scrubber or self.scrubber()
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                if text := scrubber.push(delta):
                    yield text
                if scrubber.full:
                    return
        if text := scrubber.finish():
            yield text


class Scrubber:
    """One reply's filtering state: the held-back tail and the count of characters released."""

    def __init__(self, rules: SpeechFilter) -> None:
        self.rules = rules
        self.released = 0
        self.full = False
        self.cut = ""  # the text max_chars cut off (of the delta that reached it; nothing after it is read)
        self._pending = ""
        self._context = ""  # the character before _pending, for word-boundary checks

    def push(self, delta: str) -> str:
        return self._limit(self._censor(self._pending + delta, final=False))

    def finish(self) -> str:
        return self._limit(self._censor(self._pending, final=True))

    def _censor(self, text: str, final: bool) -> str:
        rules = self.rules
        if rules.pattern is None or self.full:
            self._pending = ""
            return text
        s = self._context + text
        pos = len(self._context)
        out = []
        for match in rules.pattern.finditer(s, pos):
            if not final and match.end() == len(s):
                break  # the next delta may extend it into another word ("ass" -> "assess")
            out += [s[pos : match.start()], rules.replacement]
            pos = match.end()
        safe = len(s) if final else max(pos, len(s) - rules.hold)
        out.append(s[pos:safe])
        self._pending = s[safe:]
        if safe:
            self._context = s[safe - 1]
        return "".join(out)

    def _limit(self, text: str) -> str:
        limit = self.rules.max_chars
        if not limit or self.full:
            self.cut += text if self.full else ""
            return "" if self.full else text
        room = limit - self.released
        if len(text) > room:
            whole, text, following = text, text[:room], text[room]
            if following.isascii() and following.isalnum():
                text = _TRAILING_WORD.sub("", text)  # do not speak half a word
            self.cut = whole[len(text):]
            self.full = True
        self.released += len(text)
        return text


def _phrase_pattern(phrase: str) -> str:
    body = r"\s+".join(re.escape(word) for word in phrase.split())
    before = f"(?<![{_WORD}])" if phrase[0].isascii() and phrase[0].isalnum() else ""
    after = f"(?![{_WORD}])" if phrase[-1].isascii() and phrase[-1].isalnum() else ""
    return before + body + after
