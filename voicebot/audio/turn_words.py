"""The words as evidence of the end of a turn: what the transcript's last word says.

A turn that stops on a conjunction, a preposition, an article, an auxiliary, a subject pronoun or a
filler ("I would like to", "we need eggs and", "um") is not over, whatever its prosody; one that
ends in sentence-final punctuation (a recognizer that punctuates: paraformer with
`asr.paraformer.punc_model`, FunASR's ct-punc, voicebot/asr/punctuation.py) or, in Mandarin, on a
question or closing particle (吗, 呢, 吧) is. The lists are the
languages' closed word classes, not the test set's words. `TurnPolicy` (voicebot/audio/turn.py)
adds the cue to Smart Turn's answer in log-odds: `smart_words_hold` down, `smart_words_go` up.

Punctuation a recognizer gives decides first: a trailing comma or dash holds, a full stop or a
question mark goes. Without it (pocketsphinx, paraformer) only the last word speaks: English has
no unpunctuated word that ends a turn for sure, so English text only ever holds.
"""

from __future__ import annotations

import enum
import re

from voicebot.text import is_cjk


class Cue(enum.Enum):
    HOLD = "hold"  # the words say the user is not done
    GO = "go"  # the words say the turn is over
    NONE = "none"  # the words say nothing either way (or there are none yet)


# Only words that hardly ever end an English turn: "so", "that", "then", "in", "on", "do", "can",
# "you", "her" do ("I think so", "I like that", "come in", "I can", "thank you"), so they are left out.
HOLD_EN = frozenset("""
and or but because if than although unless whereas nor
to of for with from by between into onto at through without within against during toward towards
upon via per
the a an my your our their its every each
is am are was were i we they he she i'm we're they're gonna wanna
um uh er erm uhm hmm mm
""".split())
# Mandarin: conjunctions, prepositions and coverbs, the copula, fillers. Matched at the end of the
# text (no spaces in Chinese). Not 的, 这个, 对, 在 ("是的", "我要这个",
# "对", "他不在" end turns).
HOLD_ZH = ("因为", "所以", "但是", "可是", "而且", "或者", "然后", "如果", "虽然", "就是", "还有", "以及", "比如",
           "的话", "和", "跟", "与", "或", "但", "把", "被", "给", "从", "往", "向", "是", "嗯", "呃")
GO_ZH = ("吗", "呢", "吧")
END_GO = ".?!。？！"
END_HOLD = ",;:-，、；：—…"


def cue(text: str) -> Cue:
    """What the transcript's last word (or its punctuation) says about the turn's end."""
    text = text.strip()
    if not text:
        return Cue.NONE
    if text[-1] in END_GO:
        return Cue.GO
    if text[-1] in END_HOLD:
        return Cue.HOLD
    if is_cjk(text[-1]):
        if text.endswith(GO_ZH):
            return Cue.GO
        return Cue.HOLD if text.endswith(HOLD_ZH) else Cue.NONE
    words = re.findall(r"[\w']+", text.lower())
    return Cue.HOLD if words and words[-1] in HOLD_EN else Cue.NONE


def unpunctuated(text: str) -> str:
    """The text as a recognizer without punctuation gives it (pocketsphinx, paraformer)."""
    return " ".join(re.sub(r"[^\w\s']", " ", text).split())
